//! The table through which a host's programs read the latest AUSS stamp per destination
//! (docs/softrnic-congestion.md, "AUSS in the NIC's ACKs"): a file in the host's run
//! directory, `<run>/hosts/NAME/auss`, that the engine maps read-write and programs map
//! read-only. Its path is in the device's sysfs directory, `<ibdev_path>/softrnic_auss`;
//! the file exists only while the engine runs AUSS, so its presence is the feature's.
//!
//! Layout (little endian, every field naturally aligned):
//!
//! ```text
//! header, 64 bytes:  magic [8] = "SRNAUSS1" | slots u32 | slot_len u32 (64) | zeros
//! slot i at 64 + 64·i:
//!   seq u32          seqlock: odd while the engine writes the slot, 0 for a slot never used
//!   ip u32           the destination's IPv4 address, first octet in the lowest byte
//!   n u32            active unique senders at the destination, as of:
//!   zero u32
//!   epoch u64        the destination engine's epoch
//!   incarnation u64  the destination engine's life (epochs restart with a new one)
//!   updated_ns u64   CLOCK_MONOTONIC when this engine accepted the stamp
//!   zeros to 64 bytes
//! ```
//!
//! A slot, once given to a destination, keeps it for the engine's life, so a reader may
//! remember where its destinations are. To read a slot: load `seq` (acquire); if odd, retry;
//! read the fields; load `seq` again after an acquire fence; if it changed, retry. A read is
//! a few loads of shared memory — no system call, no round trip to the engine. A reader gives
//! up after [`READ_TRIES`] tries and takes the slot as absent: an engine that died in the
//! middle of an update leaves its `seq` odd for ever, and a reader inside an application
//! must not spin for ever on it.

use std::fs::OpenOptions;
use std::net::Ipv4Addr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

use crate::auss::Stamp;

pub const MAGIC: [u8; 8] = *b"SRNAUSS1";
pub const HEADER_LEN: usize = 64;
pub const SLOT_LEN: usize = 64;
/// Destinations one host's table holds (more than the hosts a run has; a destination
/// beyond it is counted in `auss_table_full` and not shown).
pub const SLOTS: usize = 256;
const FILE_LEN: usize = HEADER_LEN + SLOTS * SLOT_LEN;

/// A destination's entry as a reader sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub ip: Ipv4Addr,
    pub stamp: Stamp,
    pub updated_ns: u64,
}

/// A shared mapping of the table file.
struct Mapping {
    base: *mut u8,
    len: usize,
}

// SAFETY: the mapping is only accessed through atomics (and the header's plain bytes,
// written before it is shared), so sharing it across threads is sound.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    fn map(file: &std::fs::File, writable: bool) -> std::io::Result<Mapping> {
        use std::os::fd::AsRawFd;
        let len = file.metadata()?.len() as usize;
        if len != FILE_LEN {
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
        // SAFETY: a fresh mapping of `len` bytes of an open file; the kernel checks the
        // arguments and we check the result.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Mapping {
            base: base.cast(),
            len,
        })
    }

    fn u32_at(&self, off: usize) -> &AtomicU32 {
        assert!(off % 4 == 0 && off + 4 <= self.len);
        // SAFETY: in bounds and aligned (the mapping is page-aligned), and the mapping lives
        // as long as `self`; every access to the shared bytes is atomic.
        unsafe { &*self.base.add(off).cast::<AtomicU32>() }
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        assert!(off % 8 == 0 && off + 8 <= self.len);
        // SAFETY: as in `u32_at`.
        unsafe { &*self.base.add(off).cast::<AtomicU64>() }
    }

    fn bytes(&self, n: usize) -> &[u8] {
        assert!(n <= self.len);
        // SAFETY: in bounds; only the header, which the engine wrote before the file was
        // mapped by anyone else and never changes, is read this way.
        unsafe { std::slice::from_raw_parts(self.base, n) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `map` mapped; nothing refers to it any more.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

fn slot_off(i: usize) -> usize {
    HEADER_LEN + i * SLOT_LEN
}

/// How often a reader tries a slot before it takes it as absent. An update is six stores, so
/// a live writer holds a slot odd for nanoseconds; this many tries take about a millisecond.
pub const READ_TRIES: u32 = 100_000;

/// The engine's side: one writer (under the engine's lock).
pub struct Writer {
    map: Mapping,
    used: Vec<Ipv4Addr>,
}

impl Writer {
    /// Creates the table at `path` (replacing an older one), readable by every user.
    pub fn create(path: &Path) -> std::io::Result<Writer> {
        let tmp = path.with_extension("new");
        let mut header = vec![0u8; FILE_LEN];
        header[..8].copy_from_slice(&MAGIC);
        header[8..12].copy_from_slice(&(SLOTS as u32).to_le_bytes());
        header[12..16].copy_from_slice(&(SLOT_LEN as u32).to_le_bytes());
        {
            use std::io::Write;
            let mut f = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o644)
                .open(&tmp)?;
            f.write_all(&header)?;
        }
        std::fs::rename(&tmp, path)?;
        let f = OpenOptions::new().read(true).write(true).open(path)?;
        Ok(Writer {
            map: Mapping::map(&f, true)?,
            used: Vec::new(),
        })
    }

    /// Publishes `stamp` for `ip`; false when the table is full.
    pub fn publish(&mut self, ip: Ipv4Addr, stamp: Stamp) -> bool {
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
        let seq = m.u32_at(o);
        let s = seq.load(Ordering::Relaxed);
        seq.store(s.wrapping_add(1) | 1, Ordering::Relaxed);
        // Readers that see any field below see the odd sequence first.
        fence(Ordering::Release);
        m.u32_at(o + 4)
            .store(u32::from_le_bytes(ip.octets()), Ordering::Relaxed);
        m.u32_at(o + 8).store(stamp.n, Ordering::Relaxed);
        m.u64_at(o + 16).store(stamp.epoch, Ordering::Relaxed);
        m.u64_at(o + 24).store(stamp.incarnation, Ordering::Relaxed);
        m.u64_at(o + 32).store(monotonic_ns(), Ordering::Relaxed);
        // Even again, never 0 (which marks a slot never used).
        seq.store((s | 1).wrapping_add(1).max(2), Ordering::Release);
        true
    }
}

/// A program's side (and `softrnic auss`): the table mapped read-only.
pub struct Reader {
    map: Mapping,
}

impl Reader {
    pub fn open(path: &Path) -> std::io::Result<Reader> {
        let f = OpenOptions::new().read(true).open(path)?;
        let map = Mapping::map(&f, false)?;
        let h = map.bytes(16);
        let slots = u32::from_le_bytes(h[8..12].try_into().unwrap()) as usize;
        let slot_len = u32::from_le_bytes(h[12..16].try_into().unwrap()) as usize;
        if h[..8] != MAGIC || slots != SLOTS || slot_len != SLOT_LEN {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "not an AUSS table of this version",
            ));
        }
        Ok(Reader { map })
    }

    /// Slot `i` as one consistent snapshot; None while never used, or while it stays in
    /// the middle of an update for [`READ_TRIES`] tries.
    pub fn slot(&self, i: usize) -> Option<Entry> {
        let o = slot_off(i);
        let m = &self.map;
        for _ in 0..READ_TRIES {
            let s1 = m.u32_at(o).load(Ordering::Acquire);
            if s1 == 0 {
                return None;
            }
            if s1 & 1 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let ip = m.u32_at(o + 4).load(Ordering::Relaxed);
            let e = Entry {
                ip: Ipv4Addr::from(ip.to_le_bytes()),
                stamp: Stamp {
                    n: m.u32_at(o + 8).load(Ordering::Relaxed),
                    epoch: m.u64_at(o + 16).load(Ordering::Relaxed),
                    incarnation: m.u64_at(o + 24).load(Ordering::Relaxed),
                },
                updated_ns: m.u64_at(o + 32).load(Ordering::Relaxed),
            };
            fence(Ordering::Acquire);
            if m.u32_at(o).load(Ordering::Relaxed) == s1 {
                return Some(e);
            }
        }
        None
    }

    /// Every destination in the table, in slot order.
    pub fn entries(&self) -> Vec<Entry> {
        (0..SLOTS).map_while(|i| self.slot(i)).collect()
    }

    pub fn get(&self, ip: Ipv4Addr) -> Option<Entry> {
        self.entries().into_iter().find(|e| e.ip == ip)
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
        let dir = std::env::temp_dir().join(format!("srn-auss-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("auss");
        let mut w = Writer::create(&path).unwrap();
        let r = Reader::open(&path).unwrap();
        assert!(r.entries().is_empty());
        let (h1, h2) = (Ipv4Addr::new(10, 77, 0, 1), Ipv4Addr::new(10, 77, 0, 2));
        let st = |n, epoch| Stamp {
            n,
            epoch,
            incarnation: 5,
        };
        assert!(w.publish(h1, st(1, 1)));
        assert!(w.publish(h2, st(2, 4)));
        let before = monotonic_ns();
        assert!(w.publish(h1, st(2, 2)));
        let e = r.get(h1).unwrap();
        assert_eq!(e.stamp, st(2, 2));
        assert!(e.updated_ns >= before && e.updated_ns <= monotonic_ns());
        assert_eq!(
            r.entries().iter().map(|e| e.ip).collect::<Vec<_>>(),
            [h1, h2]
        );
        for i in 0..(SLOTS - 2) as u32 {
            assert!(w.publish(Ipv4Addr::from(i + 0x0b00_0000), st(1, 1)));
        }
        assert!(!w.publish(Ipv4Addr::new(12, 0, 0, 1), st(1, 1)), "full");
        assert_eq!(r.entries().len(), SLOTS);
        // An engine that dies in the middle of an update: its slot reads as absent after the reader's tries.
        w.map.u32_at(slot_off(0)).store(3, Ordering::Relaxed);
        assert_eq!(r.slot(0), None);
        assert_eq!(r.slot(1).unwrap().ip, h2);
        std::fs::write(dir.join("short"), b"SRNAUSS1").unwrap();
        assert!(Reader::open(&dir.join("short")).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
