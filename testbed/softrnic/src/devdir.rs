//! The device nodes libibverbs and librdmacm require, `/dev/infiniband/uverbs0` (and
//! `uverbs1`… for the further devices of `up --devices`) and `/dev/infiniband/rdma_cm`, made visible only to the program `exec` runs, in a private mount
//! namespace. Libibverbs accepts any character device
//! there whose numbers are sysfs's `dev`; we use 1:7, the kernel's "full" device: opening succeeds,
//! ioctl() fails with ENOTTY so libibverbs falls back to its sysfs paths, and any kernel command
//! it would write() fails loudly (ENOSPC) instead of silently succeeding. As root the node is
//! made with mknod in a tmpfs on `/dev/infiniband`; without root, see [`private_devdir_userns`].

use std::ffi::CString;
use std::fs;
use std::os::unix::fs::symlink;
use std::path::Path;

use anyhow::{bail, Context, Result};

use crate::device;

pub const DEVDIR: &str = "/dev/infiniband";
/// The device numbers of every node: the kernel's "full" device (see above); sysfs reports
/// them as the uverbs devices' `dev`.
pub const NODE_DEV: (u32, u32) = (1, 7);
/// The verbs device and the RDMA CM's device; the provider turns an open of the latter into an
/// RDMA CM channel (served inside each program by softrnic-provider's `rdma_cm`).
/// Every device a host may offer gets its node, whether or not the run has it: libibverbs
/// opens only those its sysfs tree lists.
fn nodes() -> impl Iterator<Item = String> {
    (0..device::MAX_DEVICES)
        .map(device::uverbs_name)
        .chain(["rdma_cm".to_string()])
}

fn cstr(s: &str) -> Result<CString> {
    Ok(CString::new(s)?)
}

fn mount(
    src: &str,
    target: &str,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> Result<()> {
    let (c_src, c_target) = (cstr(src)?, cstr(target)?);
    let c_fstype = fstype.map(cstr).transpose()?;
    let c_data = data.map(cstr).transpose()?;
    // SAFETY: valid NUL-terminated strings (or NULL) that outlive the call.
    let r = unsafe {
        libc::mount(
            c_src.as_ptr(),
            c_target.as_ptr(),
            c_fstype.as_ref().map_or(std::ptr::null(), |s| s.as_ptr()),
            flags,
            c_data
                .as_ref()
                .map_or(std::ptr::null(), |s| s.as_ptr() as *const libc::c_void),
        )
    };
    if r != 0 {
        bail!(
            "mount {src} on {target}: {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}

/// A mount namespace of our own in which nothing propagates back to the host.
fn private_mount_namespace() -> Result<()> {
    // SAFETY: unshare has no memory-safety preconditions; this runs single-threaded before exec.
    if unsafe { libc::unshare(libc::CLONE_NEWNS) } != 0 {
        bail!("unshare(CLONE_NEWNS): {}", std::io::Error::last_os_error());
    }
    mount("none", "/", None, libc::MS_REC | libc::MS_PRIVATE, None).context("making / private")
}

/// As root: a private mount namespace and a new device node 1:7 in the tmpfs.
pub fn private_devdir_root() -> Result<()> {
    private_mount_namespace()?;
    mount(
        "tmpfs",
        DEVDIR,
        Some("tmpfs"),
        libc::MS_NOSUID | libc::MS_NOEXEC,
        Some("mode=0755,size=64k"),
    )?;
    for name in nodes() {
        let node = cstr(&format!("{DEVDIR}/{name}"))?;
        // SAFETY: valid NUL-terminated path.
        if unsafe {
            libc::mknod(
                node.as_ptr(),
                libc::S_IFCHR | 0o666,
                libc::makedev(NODE_DEV.0, NODE_DEV.1),
            )
        } != 0
        {
            bail!("mknod {DEVDIR}/{name}: {}", std::io::Error::last_os_error());
        }
        // Open to every user, as udev makes a real NIC's nodes: processes of other uids
        // (tests of DRUM's tenants) use the device too. mknod's mode went through the umask.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(
            format!("{DEVDIR}/{name}"),
            std::fs::Permissions::from_mode(0o666),
        )?;
    }
    Ok(())
}

/// In a user namespace (see `crate::userns`) mknod is refused (EPERM), a tmpfs mounted there
/// cannot hold usable device nodes, and `/dev/infiniband` may not exist (creating it needs
/// root). So `/dev` itself is rebuilt, in this mount namespace, on a tmpfs staged at `stage`
/// (an empty directory we own): every entry of the host's `/dev` but `infiniband` — directories
/// and files bind-mounted (recursively: `/dev/pts` and `/dev/shm` keep their mounts and stay
/// shared with the host), symbolic links copied — plus `infiniband/uverbs0`, an empty file with
/// the host's `/dev/full` bind-mounted onto it. This is how unprivileged sandboxes build a
/// `/dev`: device nodes work because each stays on the host's own devtmpfs mount.
pub fn private_devdir_userns(stage: &Path) -> Result<()> {
    private_mount_namespace()?;
    fs::create_dir_all(stage)?;
    let st = stage
        .to_str()
        .with_context(|| format!("{} is not UTF-8", stage.display()))?;
    mount(
        "tmpfs",
        st,
        Some("tmpfs"),
        libc::MS_NOSUID,
        Some("mode=0755"),
    )?;
    mirror_entries(Path::new("/dev"), stage, &["infiniband"])?;
    let ib = stage.join("infiniband");
    fs::create_dir(&ib)?;
    for name in nodes() {
        bind(Path::new("/dev/full"), &ib.join(name), false)?;
    }
    mount(st, "/dev", None, libc::MS_MOVE, None)
}

/// Give `stage` every entry of `dir` except those named in `except`: directories and files
/// bind-mounted (recursively), symbolic links copied.
fn mirror_entries(dir: &Path, stage: &Path, except: &[&str]) -> Result<()> {
    for e in fs::read_dir(dir)? {
        let e = e?;
        if except.iter().any(|x| e.file_name() == *x) {
            continue;
        }
        let (src, dst) = (e.path(), stage.join(e.file_name()));
        let ft = e.file_type()?;
        if ft.is_symlink() {
            symlink(fs::read_link(&src)?, &dst)?;
        } else {
            bind(&src, &dst, ft.is_dir())?;
        }
    }
    Ok(())
}

/// The classes of a host's generated sysfs tree (under `SYSFS_PATH`) that `exec` also shows
/// at `/sys/class`, for programs that read the real path: pyverbs' RDMA CM tests look for
/// `/sys/class/infiniband/<dev>/device/net/<ifname>` there.
const SYSFS_CLASSES: [&str; 2] = ["infiniband", "infiniband_verbs"];

/// In the private mount namespace `exec` made: `/sys/class` rebuilt on a tmpfs staged at
/// `stage` (an empty directory we own) from the host's classes, except that
/// [`SYSFS_CLASSES`] come from `host_class` (the host's generated `sys/class`). The kernel
/// may have no `/sys/class/infiniband` to bind over (no RDMA support), and sysfs takes no
/// new directories, so the whole of `/sys/class` is staged, as `/dev` is without root.
pub fn private_sysfs_class(stage: &Path, host_class: &Path) -> Result<()> {
    fs::create_dir_all(stage)?;
    let st = stage
        .to_str()
        .with_context(|| format!("{} is not UTF-8", stage.display()))?;
    mount(
        "tmpfs",
        st,
        Some("tmpfs"),
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        Some("mode=0755"),
    )?;
    mirror_entries(Path::new("/sys/class"), stage, &SYSFS_CLASSES)?;
    for class in SYSFS_CLASSES {
        bind(&host_class.join(class), &stage.join(class), true)?;
    }
    mount(st, "/sys/class", None, libc::MS_MOVE, None)
}

/// Bind-mount `src` onto a new directory or empty file `dst`.
fn bind(src: &Path, dst: &Path, dir: bool) -> Result<()> {
    if dir {
        fs::create_dir(dst)?;
    } else {
        fs::File::create(dst)?;
    }
    let (s, d) = (src.to_string_lossy(), dst.to_string_lossy());
    mount(&s, &d, None, libc::MS_BIND | libc::MS_REC, None)
}
