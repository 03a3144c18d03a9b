//! Emulated hosts without root, through an unprivileged user namespace.
//!
//! A *holder* process (the hidden `softrnic holder` command, started by `up`) creates a user
//! namespace in which the invoking user is mapped to root, and inside it one network namespace
//! per host plus a "switch" namespace (its own) with a bridge, wired with veth links exactly as
//! in root mode. It keeps the hosts' namespaces alive as open file descriptors and then sleeps
//! until `down` kills it. Engines and `exec` join the user namespace through
//! `/proc/HOLDER/ns/user` and a host's network namespace through `/proc/HOLDER/fd/N` (the path
//! recorded in the run's state); nothing is named in `/run/netns`, so nothing outlives the
//! holder and its engines. In loopback mode the holder creates only the user namespace.
//!
//! Everything in the user namespace runs as its root: `ip` keeps `CAP_NET_ADMIN` across
//! `exec`, engines may `process_vm_readv` programs run through `exec` (whatever the Yama
//! policy), and `exec` may mount the private `/dev/infiniband` (see `crate::devdir`).

use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

use crate::hosts;

/// First word of the line the holder prints once the namespaces are ready.
const READY: &str = "ready";

fn open_ns(path: &str) -> Result<OwnedFd> {
    fs::File::open(path)
        .map(OwnedFd::from)
        .with_context(|| format!("opening {path}"))
}

fn setns(fd: &OwnedFd, kind: libc::c_int, what: &str) -> Result<()> {
    // SAFETY: setns on a namespace file descriptor we own.
    if unsafe { libc::setns(fd.as_raw_fd(), kind) } != 0 {
        bail!("setns({what}): {}", std::io::Error::last_os_error());
    }
    Ok(())
}

/// Run `ip ARGS` in the network namespace `ns` (the holder's children are root in the user
/// namespace, so `ip` has CAP_NET_ADMIN there).
fn ip_in(ns: &OwnedFd, args: &[&str]) -> Result<()> {
    let fd = ns.as_raw_fd();
    let mut cmd = Command::new("ip");
    cmd.args(args);
    // SAFETY: setns is async-signal-safe; fd is open (not yet closed by exec) in the child.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    hosts::run_checked(&mut cmd)
}

/// The hidden `holder` command: make the namespaces, report them on stdout, then sleep.
pub fn holder_main(n: usize, netns: bool) -> Result<()> {
    // SAFETY: getuid/getgid have no preconditions. Read before unshare: inside the new
    // namespace they read as the overflow id until the maps are written.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    let flags = libc::CLONE_NEWUSER | if netns { libc::CLONE_NEWNET } else { 0 };
    // SAFETY: unshare has no memory-safety preconditions; this process is single-threaded.
    if unsafe { libc::unshare(flags) } != 0 {
        let e = std::io::Error::last_os_error();
        bail!(
            "unshare(CLONE_NEWUSER{}): {e} — without root, softrnic needs unprivileged user \
             namespaces (kernel.unprivileged_userns_clone, user.max_user_namespaces); \
             or run it as root",
            if netns { "|CLONE_NEWNET" } else { "" }
        );
    }
    // An unprivileged process may map only its own ids, and must give up setgroups first.
    fs::write("/proc/self/setgroups", "deny").context("writing setgroups")?;
    fs::write("/proc/self/uid_map", format!("0 {uid} 1\n")).context("writing uid_map")?;
    fs::write("/proc/self/gid_map", format!("0 {gid} 1\n")).context("writing gid_map")?;
    let mut hosts_ns = Vec::new();
    if netns {
        let switch = open_ns("/proc/self/ns/net")?;
        ip_in(&switch, &["link", "add", "br0", "type", "bridge"])?;
        ip_in(&switch, &["link", "set", "br0", "up"])?;
        for _ in 0..n {
            // SAFETY: as above; the new namespace stays alive through the open descriptor.
            if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
                bail!("unshare(CLONE_NEWNET): {}", std::io::Error::last_os_error());
            }
            hosts_ns.push(open_ns("/proc/self/ns/net")?);
        }
        // Back in the switch: `netns PID` below then names it.
        setns(&switch, libc::CLONE_NEWNET, "switch")?;
        let me = std::process::id().to_string();
        for (i, ns) in hosts_ns.iter().enumerate() {
            let port = format!("p{}", i + 1);
            ip_in(
                ns,
                &[
                    "link",
                    "add",
                    "name",
                    hosts::NETDEV,
                    "mtu",
                    "9000",
                    "type",
                    "veth",
                    "peer",
                    "name",
                    &port,
                    "mtu",
                    "9000",
                    "netns",
                    &me,
                ],
            )?;
            let addr = format!("{}/24", hosts::netns_ip(i + 1));
            ip_in(ns, &["addr", "add", &addr, "dev", hosts::NETDEV])?;
            ip_in(ns, &["link", "set", hosts::NETDEV, "up"])?;
            ip_in(ns, &["link", "set", "lo", "up"])?;
            ip_in(&switch, &["link", "set", &port, "master", "br0"])?;
            ip_in(&switch, &["link", "set", &port, "up"])?;
        }
    }
    let fds: Vec<String> = hosts_ns.iter().map(|f| f.as_raw_fd().to_string()).collect();
    let mut out = std::io::stdout().lock();
    writeln!(out, "{READY} {}", fds.join(" "))?;
    out.flush()?;
    drop(out);
    loop {
        // SAFETY: pause has no preconditions; `down` ends this process with SIGTERM.
        unsafe { libc::pause() };
    }
}

/// Start the holder of run `run` for `n` hosts; returns its pid and, with `netns`, the path of
/// each host's network namespace.
pub fn spawn_holder(run: &Path, n: usize, netns: bool) -> Result<(i32, Vec<String>)> {
    let log = run.join("holder.log");
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.arg("--run-dir")
        .arg(run)
        .arg("holder")
        .arg("--hosts")
        .arg(n.to_string());
    if netns {
        cmd.arg("--netns");
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(fs::File::create(&log)?);
    // SAFETY: setsid is async-signal-safe; like the engines, the holder outlives `up`.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut child = cmd.spawn().context("starting the namespace holder")?;
    let pid = child.id() as i32;
    let mut line = String::new();
    let stdout = child.stdout.take().expect("piped");
    BufReader::new(stdout).read_line(&mut line)?;
    let mut words = line.split_whitespace();
    if words.next() != Some(READY) {
        let _ = child.wait();
        let why = fs::read_to_string(&log).unwrap_or_default();
        bail!("the namespace holder failed: {}", why.trim());
    }
    let paths = words.map(|fd| format!("/proc/{pid}/fd/{fd}")).collect();
    Ok((pid, paths))
}

/// Enter the holder's user namespace and, if given, one of its hosts' network namespaces.
/// The calling process must be single-threaded (a condition of joining a user namespace).
pub fn join(run: &Path, holder: i32, netns: Option<&str>) -> Result<()> {
    if !hosts::pid_is_ours(holder, run, "holder") {
        bail!("the run's namespace holder (pid {holder}) is gone; run `softrnic up` again");
    }
    // Both opened before joining: /proc/HOLDER/fd/N is checked against our credentials.
    let user = open_ns(&format!("/proc/{holder}/ns/user"))?;
    let net = netns.map(open_ns).transpose()?;
    setns(&user, libc::CLONE_NEWUSER, "user namespace")?;
    if let Some(net) = net {
        setns(&net, libc::CLONE_NEWNET, "host network namespace")?;
    }
    Ok(())
}
