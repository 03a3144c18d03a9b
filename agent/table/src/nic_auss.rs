//! The table through which a NIC that runs Dart's AUSS in its ACKs (softrnic with
//! `--auss-expiry-ms`) tells a host's programs how many active unique senders each
//! destination has (docs/softrnic-congestion.md, "AUSS in the NIC's ACKs"). The NIC's engine
//! writes it; the shim reads it on its data path to cap each QP at the destination's rate / N
//! (docs/shim.md, "Caps from the NIC"). Both link this crate, so they cannot disagree about
//! the layout.
//!
//! A file in the host's run directory, `<run>/hosts/NAME/auss`, whose path is in the
//! device's sysfs directory as `softrnic_auss`; the file exists only while the engine runs
//! AUSS, so its presence is the feature's. The engine replaces the file (rename) when it
//! starts, never truncates it: a reader's mapping can never lose its pages (no SIGBUS in an
//! application), and a reader notices a new engine by the file's inode.
//!
//! Layout (little endian, every field naturally aligned):
//!
//! ```text
//! header, 64 bytes:  magic [8] = "SRNAUSS2" | slots u32 | slot_len u32 (64)
//!                    | rate u64: a destination's line rate in bytes per second of wall-clock
//!                      time (softrnic's hosts share one NIC model; its time scale applied)
//!                    | zeros
//! slot i at 64 + 64·i:
//!   seq u64          drum_table::seqlock's sequence: odd while the engine writes the slot,
//!                    0 for a slot never used
//!   ip u32           the destination's IPv4 address, first octet in the lowest byte
//!   n u32            active unique senders at the destination, as of:
//!   epoch u64        the destination engine's epoch
//!   incarnation u64  the destination engine's life (epochs restart with a new one)
//!   updated_ns u64   CLOCK_MONOTONIC when this engine accepted the stamp
//!   zeros to 64 bytes
//! ```
//!
//! A slot, once given to a destination, keeps it for the engine's life, so a reader may
//! remember where its destinations are. A read is a few loads of shared memory under the
//! sequence lock ([`crate::seqlock`], model-checked): no system call, no round trip to the
//! engine, and bounded — a slot left odd by an engine that died mid-update reads as absent.

use crate::seqlock;
use std::fs::OpenOptions;
use std::net::Ipv4Addr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};

pub const MAGIC: [u8; 8] = *b"SRNAUSS2";
pub const HEADER_LEN: usize = 64;
pub const SLOT_LEN: usize = 64;
/// Destinations one host's table holds (more than the hosts a run has; the writer reports a
/// destination beyond it).
pub const SLOTS: usize = 256;
pub const FILE_LEN: usize = HEADER_LEN + SLOTS * SLOT_LEN;

/// How often a reader tries a slot before it takes it as absent. An update is six stores, so
/// a live writer holds a slot odd for nanoseconds; a reader on an application's data path
/// must not wait for a writer that died.
pub const READ_TRIES: usize = 1000;

/// A destination's entry as a reader sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub ip: Ipv4Addr,
    pub n: u32,
    pub epoch: u64,
    pub incarnation: u64,
    pub updated_ns: u64,
}

/// A shared mapping of the table file.
struct Mapping {
    base: *mut u8,
}

// SAFETY: the mapping is only accessed through atomics (and the header's plain bytes,
// written before it is shared), so sharing it across threads is sound.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    fn map(file: &std::fs::File, writable: bool) -> std::io::Result<Mapping> {
        use std::os::fd::AsRawFd;
        let len = file.metadata()?.len();
        if len != FILE_LEN as u64 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("AUSS table of {len} bytes (it has {FILE_LEN})"),
            ));
        }
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: a fresh mapping of FILE_LEN bytes of an open file that long; the kernel
        // checks the arguments and we check the result.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                FILE_LEN,
                prot,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Mapping { base: base.cast() })
    }

    fn u32_at(&self, off: usize) -> &AtomicU32 {
        assert!(off % 4 == 0 && off + 4 <= FILE_LEN);
        // SAFETY: in bounds and aligned (the mapping is page-aligned), and the mapping lives
        // as long as `self`; every access to the shared bytes is atomic.
        unsafe { &*self.base.add(off).cast::<AtomicU32>() }
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        assert!(off % 8 == 0 && off + 8 <= FILE_LEN);
        // SAFETY: as in `u32_at`.
        unsafe { &*self.base.add(off).cast::<AtomicU64>() }
    }

    fn header(&self) -> &[u8] {
        // SAFETY: in bounds; the header is written before the file is renamed into place
        // (before any reader can map it) and never changes.
        unsafe { std::slice::from_raw_parts(self.base, HEADER_LEN) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `map` mapped; nothing refers to it any more.
        unsafe { libc::munmap(self.base.cast(), FILE_LEN) };
    }
}

fn slot_off(i: usize) -> usize {
    HEADER_LEN + i * SLOT_LEN
}

/// The engine's side: one writer (under the engine's lock).
pub struct Writer {
    map: Mapping,
    used: Vec<Ipv4Addr>,
}

impl Writer {
    /// Creates the table at `path` (replacing an older one by rename), readable by every
    /// user, for destinations of line rate `rate` bytes per second.
    pub fn create(path: &Path, rate: u64) -> std::io::Result<Writer> {
        let tmp = path.with_extension("new");
        let mut bytes = vec![0u8; FILE_LEN];
        bytes[..8].copy_from_slice(&MAGIC);
        bytes[8..12].copy_from_slice(&(SLOTS as u32).to_le_bytes());
        bytes[12..16].copy_from_slice(&(SLOT_LEN as u32).to_le_bytes());
        bytes[16..24].copy_from_slice(&rate.to_le_bytes());
        {
            use std::io::Write;
            let mut f = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o644)
                .open(&tmp)?;
            f.write_all(&bytes)?;
        }
        std::fs::rename(&tmp, path)?;
        let f = OpenOptions::new().read(true).write(true).open(path)?;
        Ok(Writer {
            map: Mapping::map(&f, true)?,
            used: Vec::new(),
        })
    }

    /// Publishes destination `ip`'s `n` as of (`incarnation`, `epoch`); false when the table
    /// is full.
    pub fn publish(&mut self, ip: Ipv4Addr, n: u32, epoch: u64, incarnation: u64) -> bool {
        let i = match self.used.iter().position(|u| *u == ip) {
            Some(i) => i,
            None if self.used.len() < SLOTS => {
                self.used.push(ip);
                self.used.len() - 1
            }
            None => return false,
        };
        let o = slot_off(i);
        let m = &self.map;
        let seq = m.u64_at(o);
        let odd = seqlock::write_begin(seq);
        m.u32_at(o + 8)
            .store(u32::from_le_bytes(ip.octets()), Relaxed);
        m.u32_at(o + 12).store(n, Relaxed);
        m.u64_at(o + 16).store(epoch, Relaxed);
        m.u64_at(o + 24).store(incarnation, Relaxed);
        m.u64_at(o + 32).store(monotonic_ns(), Relaxed);
        seqlock::write_end(seq, odd);
        true
    }

    /// Sets slot `i`'s sequence as a writer that died mid-update leaves it.
    #[cfg(test)]
    fn leave_odd(&self, i: usize) {
        seqlock::write_begin(self.map.u64_at(slot_off(i)));
    }
}

/// A program's side (the shim, `softrnic auss`): the table mapped read-only.
pub struct Reader {
    map: Mapping,
    rate: u64,
    inode: u64,
}

impl Reader {
    pub fn open(path: &Path) -> std::io::Result<Reader> {
        use std::os::unix::fs::MetadataExt;
        let f = OpenOptions::new().read(true).open(path)?;
        let inode = f.metadata()?.ino();
        let map = Mapping::map(&f, false)?;
        let h = map.header();
        let word = |at: usize| u32::from_le_bytes(h[at..at + 4].try_into().expect("4 bytes"));
        if h[..8] != MAGIC || word(8) as usize != SLOTS || word(12) as usize != SLOT_LEN {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "not an AUSS table of this version",
            ));
        }
        let rate = u64::from_le_bytes(h[16..24].try_into().expect("8 bytes"));
        Ok(Reader { map, rate, inode })
    }

    /// A destination's line rate in wall-clock bytes per second (0: the NIC did not say).
    pub fn rate(&self) -> u64 {
        self.rate
    }

    /// The inode of the file mapped: another at the same path means a new engine.
    pub fn inode(&self) -> u64 {
        self.inode
    }

    /// Slot `i` as one consistent snapshot; None while never used, or while it stays in
    /// the middle of an update for [`READ_TRIES`] tries.
    pub fn slot(&self, i: usize) -> Option<Entry> {
        if i >= SLOTS {
            return None;
        }
        let o = slot_off(i);
        let m = &self.map;
        let (generation, e) = seqlock::read(m.u64_at(o), READ_TRIES, || Entry {
            ip: Ipv4Addr::from(m.u32_at(o + 8).load(Relaxed).to_le_bytes()),
            n: m.u32_at(o + 12).load(Relaxed),
            epoch: m.u64_at(o + 16).load(Relaxed),
            incarnation: m.u64_at(o + 24).load(Relaxed),
            updated_ns: m.u64_at(o + 32).load(Relaxed),
        })?;
        (generation > 0).then_some(e)
    }

    /// Every destination in the table, in slot order (slots are given out in order, so the
    /// first absent one ends the list).
    pub fn entries(&self) -> Vec<Entry> {
        (0..SLOTS).map_while(|i| self.slot(i)).collect()
    }

    /// Where destination `ip` is: its slot and entry.
    pub fn find(&self, ip: Ipv4Addr) -> Option<(usize, Entry)> {
        (0..SLOTS)
            .map_while(|i| self.slot(i).map(|e| (i, e)))
            .find(|(_, e)| e.ip == ip)
    }
}

/// CLOCK_MONOTONIC in ns, the clock a reader compares `updated_ns` with.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec we pass; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reader_sees_what_the_writer_published_slot_by_slot() {
        let dir = std::env::temp_dir().join(format!("drum-nic-auss-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("auss");
        let mut w = Writer::create(&path, 125_000_000).unwrap();
        let r = Reader::open(&path).unwrap();
        assert_eq!(r.rate(), 125_000_000);
        assert!(r.entries().is_empty());
        let (h1, h2) = (Ipv4Addr::new(10, 77, 0, 1), Ipv4Addr::new(10, 77, 0, 2));
        assert!(w.publish(h1, 1, 1, 5));
        assert!(w.publish(h2, 2, 4, 5));
        let before = monotonic_ns();
        assert!(w.publish(h1, 2, 2, 5));
        let (i, e) = r.find(h1).unwrap();
        assert_eq!((i, e.n, e.epoch, e.incarnation), (0, 2, 2, 5));
        assert!(e.updated_ns >= before && e.updated_ns <= monotonic_ns());
        assert_eq!(r.find(h2).unwrap().0, 1);
        assert_eq!(
            r.entries().iter().map(|e| e.ip).collect::<Vec<_>>(),
            [h1, h2]
        );
        for i in 0..(SLOTS - 2) as u32 {
            assert!(w.publish(Ipv4Addr::from(i + 0x0b00_0000), 1, 1, 5));
        }
        assert!(!w.publish(Ipv4Addr::new(12, 0, 0, 1), 1, 1, 5), "full");
        assert_eq!(r.entries().len(), SLOTS);
        assert_eq!(r.slot(SLOTS), None);
        // An engine that dies in the middle of an update: its slot reads as absent after
        // the reader's tries, and the others are still read.
        w.leave_odd(0);
        assert_eq!(r.slot(0), None);
        assert_eq!(r.slot(1).unwrap().ip, h2);
        // A new engine replaces the file: the old mapping stays valid, the inode tells.
        let inode = r.inode();
        drop(w);
        let _w2 = Writer::create(&path, 1).unwrap();
        assert_ne!(Reader::open(&path).unwrap().inode(), inode);
        assert_eq!(r.slot(1).unwrap().ip, h2);
        std::fs::write(dir.join("short"), b"SRNAUSS2").unwrap();
        assert!(Reader::open(&dir.join("short")).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
