//! The table's memory: a sealed memfd created by the agent, passed to the shim over the
//! registration socket with `SCM_RIGHTS`, and mapped shared by both.
//!
//! The agent seals the file against shrinking and growing before it hands it out, and the
//! shim refuses a file without those seals or smaller than the table: a mapping that could
//! shrink under the application would turn an agent bug into a SIGBUS in the application.

use crate::layout::{Table, TABLE_BYTES};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;

/// A shared mapping of one table. Unmapped on drop.
pub struct Mapping {
    ptr: NonNull<libc::c_void>,
}

// SAFETY: the mapping is plain shared memory accessed only through atomics.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

impl Mapping {
    /// Agent side: a new zeroed, sealed table file and its mapping, header written.
    pub fn create(name: &str) -> io::Result<(Mapping, OwnedFd)> {
        let cname = std::ffi::CString::new(name).map_err(|_| io::ErrorKind::InvalidInput)?;
        // SAFETY: a valid C string; the result is checked.
        let fd = unsafe {
            libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: plain syscalls on our own descriptor.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), TABLE_BYTES as libc::off_t) } != 0
            // SAFETY: as above, our own descriptor.
            || unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SEALS) } != 0
        {
            return Err(io::Error::last_os_error());
        }
        let m = Self::map(fd.as_raw_fd())?;
        m.table().init();
        Ok((m, fd))
    }

    /// Shim side: maps a table file received from the agent, after checking its size and
    /// seals (the header is checked by every read of the table).
    pub fn open(fd: RawFd) -> io::Result<Mapping> {
        // SAFETY: fstat into a zeroed struct on a descriptor the caller owns.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(fd, &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        if (st.st_size as u64) < TABLE_BYTES as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("table file has {} bytes, need {TABLE_BYTES}", st.st_size),
            ));
        }
        // SAFETY: plain fcntl on the caller's descriptor.
        let seals = unsafe { libc::fcntl(fd, libc::F_GET_SEALS) };
        if seals < 0 || seals & (libc::F_SEAL_SHRINK | libc::F_SEAL_GROW) == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "table file is not sealed against resizing",
            ));
        }
        Self::map(fd)
    }

    fn map(fd: RawFd) -> io::Result<Mapping> {
        // SAFETY: a shared read-write mapping of TABLE_BYTES of a file at least that long.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                TABLE_BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping {
            ptr: NonNull::new(p).ok_or(io::ErrorKind::Other)?,
        })
    }

    pub fn table(&self) -> &Table {
        // SAFETY: the mapping is TABLE_BYTES long, page-aligned, and `Table` (atomics only,
        // any bit pattern valid) fits in it (checked at compile time in `layout`).
        unsafe { &*(self.ptr.as_ptr() as *const Table) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what `map` mapped; no reference outlives `self`.
        unsafe { libc::munmap(self.ptr.as_ptr(), TABLE_BYTES) };
    }
}

/// Sends one datagram carrying `fd` (SCM_RIGHTS).
pub fn send_with_fd(sock: RawFd, data: &[u8], fd: RawFd) -> io::Result<()> {
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut cbuf = vec![0u8; space];
    // SAFETY: a zeroed msghdr pointing at live buffers.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space;
    // SAFETY: the control buffer holds one cmsg of one descriptor (CMSG_SPACE above).
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as usize;
        std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut RawFd, fd);
    }
    // SAFETY: msg is fully initialised; MSG_NOSIGNAL keeps a closed peer from raising SIGPIPE.
    let n = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Receives one datagram into `buf`; returns its length and the descriptor it carried, if
/// any (extra descriptors are closed). Length 0 is end of stream.
pub fn recv_with_fd(sock: RawFd, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut cbuf = [0u8; 256];
    // SAFETY: a zeroed msghdr pointing at live buffers.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = cbuf.len();
    // SAFETY: msg is fully initialised; received descriptors are close-on-exec.
    let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut got: Option<OwnedFd> = None;
    // SAFETY: walking the control messages the kernel wrote into cbuf.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c) as *const RawFd;
                let count =
                    ((*c).cmsg_len - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    let fd = OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i)));
                    if got.is_none() {
                        got = Some(fd);
                    }
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & libc::MSG_TRUNC != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "datagram longer than the buffer",
        ));
    }
    Ok((n as usize, got))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Grant;

    #[test]
    fn a_table_passed_over_a_socket_is_shared() {
        let mut sv = [0; 2];
        assert_eq!(
            // SAFETY: socketpair into a 2-element array.
            unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_SEQPACKET, 0, sv.as_mut_ptr()) },
            0
        );
        // SAFETY: fresh descriptors we own.
        let (a, b) = unsafe { (OwnedFd::from_raw_fd(sv[0]), OwnedFd::from_raw_fd(sv[1])) };
        let (agent, fd) = Mapping::create("drum-test").unwrap();
        send_with_fd(a.as_raw_fd(), b"hello", fd.as_raw_fd()).unwrap();
        let mut buf = [0u8; 64];
        let (n, got) = recv_with_fd(b.as_raw_fd(), &mut buf).unwrap();
        assert_eq!(&buf[..n], b"hello");
        let shim = Mapping::open(got.unwrap().as_raw_fd()).unwrap();
        agent.table().publish(
            &Grant {
                rate_bytes_per_s: 42,
                ..Grant::default()
            },
            1,
        );
        assert_eq!(shim.table().read_grant().unwrap().rate_bytes_per_s, 42);
    }

    #[test]
    fn unsealed_or_short_files_are_refused() {
        // SAFETY: valid C string; checked below.
        let fd = unsafe { libc::memfd_create(c"x".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: our descriptor.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        assert!(Mapping::open(fd.as_raw_fd()).is_err(), "empty file");
        // SAFETY: our descriptor.
        unsafe { libc::ftruncate(fd.as_raw_fd(), TABLE_BYTES as libc::off_t) };
        let e = Mapping::open(fd.as_raw_fd()).err().unwrap();
        assert!(e.to_string().contains("sealed"), "{e}");
    }
}
