//! The registration socket's plumbing, shared by the agent, the shim and their tests: Unix
//! `SOCK_SEQPACKET` sockets on a path (message boundaries kept, so a half message never
//! arrives), non-blocking sends that never raise SIGPIPE, receive timeouts, and the peer's
//! pid as the kernel knows it.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::time::Duration;

fn sockaddr(path: &Path) -> io::Result<libc::sockaddr_un> {
    use std::os::unix::ffi::OsStrExt;
    let bytes = path.as_os_str().as_bytes();
    // SAFETY: a zeroed sockaddr_un is valid.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if bytes.is_empty() || bytes.len() >= addr.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("socket path {} is empty or too long", path.display()),
        ));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    Ok(addr)
}

const ADDR_LEN: libc::socklen_t = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;

fn seqpacket() -> io::Result<OwnedFd> {
    // SAFETY: plain socket creation; checked.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Connects to the socket at `path`.
pub fn connect(path: &Path) -> io::Result<OwnedFd> {
    let addr = sockaddr(path)?;
    let fd = seqpacket()?;
    // SAFETY: connecting with a valid, initialised address.
    if unsafe {
        libc::connect(
            fd.as_raw_fd(),
            (&addr as *const libc::sockaddr_un).cast(),
            ADDR_LEN,
        )
    } != 0
    {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// A listening socket bound at `path` (which must not exist).
pub fn listen(path: &Path, backlog: i32) -> io::Result<OwnedFd> {
    let addr = sockaddr(path)?;
    let fd = seqpacket()?;
    // SAFETY: binding and listening on our socket with a valid address.
    unsafe {
        if libc::bind(
            fd.as_raw_fd(),
            (&addr as *const libc::sockaddr_un).cast(),
            ADDR_LEN,
        ) != 0
            || libc::listen(fd.as_raw_fd(), backlog) != 0
        {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(fd)
}

/// Sends one message without blocking and without SIGPIPE.
pub fn send(fd: RawFd, data: &[u8]) -> io::Result<()> {
    // SAFETY: sending our buffer.
    let n = unsafe {
        libc::send(
            fd,
            data.as_ptr().cast(),
            data.len(),
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Receives one message; its length is returned even when it was longer than `buf`
/// (`MSG_TRUNC`), so the caller can refuse it. 0 is the end of the connection.
pub fn recv(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: reading into our buffer.
    let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_TRUNC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Sets (or with `None` clears) the timeout of blocking receives.
pub fn set_recv_timeout(fd: RawFd, t: Option<Duration>) -> io::Result<()> {
    let t = t.unwrap_or_default();
    let tv = libc::timeval {
        tv_sec: t.as_secs() as libc::time_t,
        tv_usec: t.subsec_micros() as libc::suseconds_t,
    };
    // SAFETY: setting an option of our socket from a valid timeval.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The peer's pid as the kernel recorded it at connect time.
pub fn peer_pid(fd: RawFd) -> Option<u32> {
    peer_cred(fd).map(|c| c.0)
}

/// The peer's pid, uid and gid as the kernel recorded them at connect time (`SO_PEERCRED`):
/// who the peer is, whatever it says.
pub fn peer_cred(fd: RawFd) -> Option<(u32, u32, u32)> {
    // SAFETY: getsockopt into a zeroed ucred of the right size.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: as above.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (r == 0).then_some((cred.pid as u32, cred.uid, cred.gid))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_keep_their_boundaries_and_the_peer_is_known() {
        let dir = std::env::temp_dir().join(format!("drum-table-sock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.sock");
        let _ = std::fs::remove_file(&path);
        let l = listen(&path, 4).unwrap();
        let c = connect(&path).unwrap();
        // SAFETY: accepting on our listener.
        let a = unsafe { libc::accept(l.as_raw_fd(), std::ptr::null_mut(), std::ptr::null_mut()) };
        // SAFETY: a fresh descriptor.
        let a = unsafe { OwnedFd::from_raw_fd(a) };
        send(c.as_raw_fd(), b"one").unwrap();
        send(c.as_raw_fd(), b"two!").unwrap();
        let mut buf = [0u8; 8];
        assert_eq!(recv(a.as_raw_fd(), &mut buf).unwrap(), 3);
        assert_eq!(
            recv(a.as_raw_fd(), &mut buf[..2]).unwrap(),
            4,
            "the full length of a truncated message"
        );
        assert_eq!(peer_pid(a.as_raw_fd()), Some(std::process::id()));
        set_recv_timeout(a.as_raw_fd(), Some(Duration::from_millis(20))).unwrap();
        assert!(recv(a.as_raw_fd(), &mut buf).is_err(), "times out");
        drop(c);
        set_recv_timeout(a.as_raw_fd(), None).unwrap();
        assert_eq!(
            recv(a.as_raw_fd(), &mut buf).unwrap(),
            0,
            "end of connection"
        );
        assert!(connect(&dir.join("none.sock")).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
