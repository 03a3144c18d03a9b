//! Memory of the applications: the engine reads what they send and writes what they receive
//! straight in their address spaces with `process_vm_readv`/`process_vm_writev`, as a NIC's
//! DMA does, over scatter/gather lists of (address, length) segments.

use crate::wire::Payload;
use std::io;

type CrossMemoryFn = unsafe extern "C" fn(
    libc::pid_t,
    *const libc::iovec,
    libc::c_ulong,
    *const libc::iovec,
    libc::c_ulong,
    libc::c_ulong,
) -> libc::ssize_t;

/// Moves `len` bytes between `local` in this process and `addr` in `pid` with `op`
/// (`process_vm_readv` or `process_vm_writev`), looping over partial transfers.
///
/// # Safety
/// `local` must be valid for `len` bytes in the direction `op` uses it (written by readv, read by
/// writev); the kernel checks the remote range against the target's address space.
unsafe fn cross_memory(
    op: CrossMemoryFn,
    pid: i32,
    addr: u64,
    local: *mut u8,
    len: usize,
) -> io::Result<()> {
    let mut done = 0usize;
    while done < len {
        let local = libc::iovec {
            // SAFETY: done < len, so the offset stays inside the caller's buffer.
            iov_base: unsafe { local.add(done) } as *mut libc::c_void,
            iov_len: len - done,
        };
        let remote = libc::iovec {
            iov_base: (addr as usize + done) as *mut libc::c_void,
            iov_len: len - done,
        };
        // SAFETY: the local iovec lies inside the caller's buffer (see the function's contract).
        let n = unsafe { op(pid, &local, 1, &remote, 1, 0) };
        done += moved(n)?;
    }
    Ok(())
}

pub(super) fn read_mem(pid: i32, addr: u64, buf: &mut [u8]) -> io::Result<()> {
    // SAFETY: `buf` is valid and writable for its whole length.
    unsafe {
        cross_memory(
            libc::process_vm_readv,
            pid,
            addr,
            buf.as_mut_ptr(),
            buf.len(),
        )
    }
}

pub(super) fn write_mem(pid: i32, addr: u64, data: &[u8]) -> io::Result<()> {
    // SAFETY: `data` is valid for reads for its whole length, and writev only reads it.
    unsafe {
        cross_memory(
            libc::process_vm_writev,
            pid,
            addr,
            data.as_ptr() as *mut u8,
            data.len(),
        )
    }
}

/// `len` bytes of the segment list from byte `offset` on, in a new buffer. Read straight
/// into its allocation: zeroing it first cost as much as a copy.
pub(super) fn gather(
    pid: i32,
    segs: &[(u64, u64)],
    offset: u64,
    len: usize,
) -> io::Result<Vec<u8>> {
    let mut v = Vec::<u8>::with_capacity(len);
    let mut done = 0;
    for (addr, r) in pieces(segs, offset, len) {
        done = r.end;
        // SAFETY: the range lies inside the allocation's `len` bytes of capacity, which
        // readv writes (through a raw pointer: no reference to uninitialised bytes is made).
        unsafe {
            cross_memory(
                libc::process_vm_readv,
                pid,
                addr,
                v.as_mut_ptr().add(r.start),
                r.len(),
            )?
        };
    }
    if done != len {
        return Err(io::Error::from_raw_os_error(libc::EFAULT));
    }
    // SAFETY: the pieces cover 0..len back to back and every read moved all of its bytes
    // (`cross_memory` fails otherwise), so all `len` bytes are initialised.
    unsafe { v.set_len(len) };
    Ok(v)
}

/// Where `len` bytes at byte `offset` of a segment list lie: (address, their range in the
/// bytes), in order. They cover fewer than `len` bytes when the list ends first.
pub(super) fn pieces(
    segs: &[(u64, u64)],
    mut offset: u64,
    len: usize,
) -> impl Iterator<Item = (u64, std::ops::Range<usize>)> + '_ {
    let mut pos = 0usize;
    segs.iter().filter_map(move |&(addr, seg_len)| {
        if pos == len {
            return None;
        }
        if offset >= seg_len {
            offset -= seg_len;
            return None;
        }
        let n = ((seg_len - offset) as usize).min(len - pos);
        let piece = (addr + offset, pos..pos + n);
        pos += n;
        offset = 0;
        Some(piece)
    })
}

/// Bytes a `process_vm_readv`/`writev` call moved, or why it moved none (0: the remote
/// range ended, as `EFAULT`).
fn moved(n: isize) -> io::Result<usize> {
    match n {
        n if n < 0 => Err(io::Error::last_os_error()),
        0 => Err(io::Error::from_raw_os_error(libc::EFAULT)),
        n => Ok(n as usize),
    }
}

/// Most iovecs one `process_vm_writev` takes (Linux's `IOV_MAX`).
const IOV_MAX: usize = 1024;

/// Write `parts` back to back at `addr` in `pid`: one `process_vm_writev` whose local iovecs
/// point at the parts themselves (no gathering copy), more only beyond [`IOV_MAX`] parts or
/// when the kernel stops short.
pub(super) fn write_mem_parts(pid: i32, addr: u64, parts: &[Payload]) -> io::Result<()> {
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let mut done = 0usize;
    while done < total {
        let iov = iovecs_from(parts, done);
        let len: usize = iov.iter().map(|v| v.iov_len).sum();
        let remote = libc::iovec {
            iov_base: (addr as usize + done) as *mut libc::c_void,
            iov_len: len,
        };
        // SAFETY: the local iovecs point into the live buffers of `parts`, which writev only
        // reads; the kernel checks the remote range against the target's address space.
        let n = unsafe {
            libc::process_vm_writev(pid, iov.as_ptr(), iov.len() as libc::c_ulong, &remote, 1, 0)
        };
        done += moved(n)?;
    }
    Ok(())
}

/// Iovecs for the bytes of `parts` from byte `skip` on, at most [`IOV_MAX`] of them.
fn iovecs_from(parts: &[Payload], mut skip: usize) -> Vec<libc::iovec> {
    parts
        .iter()
        .filter_map(|p| {
            if skip >= p.len() {
                skip -= p.len();
                return None;
            }
            let rest = &p[skip..];
            skip = 0;
            Some(libc::iovec {
                iov_base: rest.as_ptr() as *mut libc::c_void,
                iov_len: rest.len(),
            })
        })
        .take(IOV_MAX)
        .collect()
}

/// Copy `data` into the segment list at byte `offset`.
pub(super) fn scatter(pid: i32, segs: &[(u64, u64)], offset: u64, data: &[u8]) -> io::Result<()> {
    let mut done = 0;
    for (addr, r) in pieces(segs, offset, data.len()) {
        done = r.end;
        write_mem(pid, addr, &data[r])?;
    }
    if done == data.len() {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(libc::EMSGSIZE))
    }
}
