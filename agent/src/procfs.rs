//! What `/proc` says of a process: its cgroup, owner, executable, the RDMA devices it holds
//! open and whether the shim is mapped in it. Every reader returns `None` (or empty) when the
//! process is gone or hides from us: the callers treat a process they cannot see as one
//! they know nothing of, never as an error.

use std::path::Path;

/// The cgroup that identifies a process to an operator, from the text of
/// `/proc/PID/cgroup`: the unified hierarchy's path (`0::PATH`) when it says more than `/`,
/// else systemd's own hierarchy on a hybrid (v1) system, else whatever there is; `/` when
/// nothing parses.
pub fn parse_cgroup(text: &str) -> String {
    let mut unified = None;
    let mut systemd = None;
    let mut first = None;
    for line in text.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(_), Some(ctl), Some(path)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        if !path.starts_with('/') {
            continue;
        }
        if ctl.is_empty() {
            unified.get_or_insert(path);
        } else if ctl == "name=systemd" {
            systemd.get_or_insert(path);
        }
        first.get_or_insert(path);
    }
    unified
        .filter(|p| *p != "/")
        .or(systemd)
        .or(unified)
        .or(first)
        .unwrap_or("/")
        .to_string()
}

pub fn cgroup(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .map_or_else(|_| "/".into(), |t| parse_cgroup(&t))
}

/// The real uid and gid (`Uid:`/`Gid:` of `/proc/PID/status`).
pub fn owner(pid: u32) -> Option<(u32, u32)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| -> Option<u32> {
        let line = text.lines().find(|l| l.starts_with(name))?;
        line[name.len()..].split_whitespace().next()?.parse().ok()
    };
    Some((field("Uid:")?, field("Gid:")?))
}

/// From the text of `/proc/PID/stat`: whether the process has exited (a zombie, `Z`, waiting
/// for its parent), and when it started (the 22nd field, clock ticks since boot) — a pid's
/// number is reused, its start time with it is not, and `exec` keeps both.
pub fn parse_stat(stat: &str) -> Option<(bool, u64)> {
    // The command name (field 2) may hold spaces and parentheses: count after its last ')'.
    let mut f = stat[stat.rfind(')')? + 1..].split_whitespace();
    let zombie = f.next()? == "Z";
    Some((zombie, f.nth(18)?.parse().ok()?))
}

pub fn start_time(pid: u32) -> Option<u64> {
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?).map(|s| s.1)
}

/// The effective uid and gid from the text of `/proc/PID/status` (the second value of
/// `Uid:`/`Gid:`): what `SO_PEERCRED` reported at registration.
pub fn parse_effective_ids(status: &str) -> Option<(u32, u32)> {
    let field = |name: &str| -> Option<u32> {
        let line = status.lines().find(|l| l.starts_with(name))?;
        line[name.len()..].split_whitespace().nth(1)?.parse().ok()
    };
    Some((field("Uid:")?, field("Gid:")?))
}

/// The effective ids of `pid`'s threads that differ from its leader's `leader`, each once, in
/// thread id order. Credentials are per thread in Linux: glibc's `setresuid` changes every
/// thread, but a raw system call changes only its caller's, which then uses the NIC as the
/// new identity.
fn other_thread_ids(pid: u32, leader: (u32, u32)) -> Vec<(u32, u32)> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    let mut tids: Vec<u32> = dir
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    tids.sort_unstable();
    tids.into_iter()
        .filter_map(|t| {
            let status = std::fs::read_to_string(format!("/proc/{pid}/task/{t}/status")).ok()?;
            parse_effective_ids(&status)
        })
        .filter(|ids| *ids != leader)
        .fold(Vec::new(), |mut v, ids| {
            if !v.contains(&ids) {
                v.push(ids);
            }
            v
        })
}

/// What `/proc` says of a registered process now, for the identity re-check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Seen {
    /// Its start time, effective uid and gid (its leader's), cgroup, and the effective uid
    /// and gid of any thread that differs from its leader.
    Alive {
        started: u64,
        uid: u32,
        gid: u32,
        cgroup: String,
        threads: Vec<(u32, u32)>,
    },
    /// No process has the pid, or only an exited one (a zombie).
    Gone,
    /// A process has it, but `/proc` does not show us enough (`hidepid`, a race with its
    /// exit): nothing can be concluded.
    Hidden,
}

pub fn seen(pid: u32) -> Seen {
    let dir = format!("/proc/{pid}");
    let read = |f: &str| std::fs::read_to_string(format!("{dir}/{f}")).ok();
    let alive = (|| {
        let (zombie, started) = parse_stat(&read("stat")?)?;
        if zombie {
            return Some(Seen::Gone);
        }
        let (uid, gid) = parse_effective_ids(&read("status")?)?;
        let threads = other_thread_ids(pid, (uid, gid));
        let cgroup = parse_cgroup(&read("cgroup")?);
        // Read again: a process that exited and gave its pid to another between the reads
        // would mix two processes' fields.
        (parse_stat(&read("stat")?)? == (false, started)).then_some(Seen::Alive {
            started,
            uid,
            gid,
            cgroup,
            threads,
        })
    })();
    alive.unwrap_or_else(|| {
        // `/proc` hides other users' processes under `hidepid`; the kernel still says
        // whether the pid exists (EPERM: it does, not ours).
        // SAFETY: signal 0 only checks that the process exists and may be signalled.
        let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
        let gone = r != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if gone {
            Seen::Gone
        } else {
            Seen::Hidden
        }
    })
}

pub fn exe(pid: u32) -> String {
    std::fs::read_link(format!("/proc/{pid}/exe"))
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "?".into())
}

/// Every process id in `/proc`.
pub fn pids() -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect()
}

/// Whether the process holds open a file whose path starts with one of `prefixes`
/// (`/dev/infiniband/uverbs`: a verbs device; the path as the process's own mount namespace
/// names it, which is how softrnic's private `/dev/infiniband` shows too).
pub fn holds_device(pid: u32, prefixes: &[String]) -> bool {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    dir.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .any(|t| {
            let t = t.to_string_lossy();
            prefixes.iter().any(|p| t.starts_with(p.as_str()))
        })
}

/// Which of `names` appear among the files the process has mapped (`/proc/PID/maps`).
pub fn mapped(pid: u32, names: &[&str]) -> Vec<bool> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    names.iter().map(|n| text.contains(n)).collect()
}

/// The process's network namespace (`net:[INODE]`), to tell the emulated hosts of one
/// machine apart.
pub fn netns(pid: &str) -> Option<String> {
    let p = Path::new("/proc").join(pid).join("ns/net");
    std::fs::read_link(p)
        .ok()
        .map(|t| t.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cgroup_is_the_unified_path_else_systemds() {
        assert_eq!(
            parse_cgroup("0::/system.slice/kv.service\n"),
            "/system.slice/kv.service"
        );
        let hybrid = "9:name=systemd:/user.slice/user-1000.slice\n4:memory:/x\n0::/\n";
        assert_eq!(parse_cgroup(hybrid), "/user.slice/user-1000.slice");
        assert_eq!(parse_cgroup("4:memory:/x\n0::/\n"), "/");
        assert_eq!(parse_cgroup("4:memory:/x\n"), "/x");
        assert_eq!(parse_cgroup("garbage\n\u{0}::\n"), "/");
    }

    #[test]
    fn start_time_and_effective_ids_are_read_past_odd_names() {
        let stat = "42 (a) b (c)) S 1 42 42 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 987654 1000 1\n";
        assert_eq!(parse_stat(stat), Some((false, 987654)));
        assert_eq!(
            parse_stat(&stat.replace(") S", ") Z")),
            Some((true, 987654))
        );
        assert_eq!(parse_stat("42 (x) S 1"), None);
        let status = "Name:\tx\nUid:\t0\t42101\t0\t42101\nGid:\t5\t42102\t5\t5\n";
        assert_eq!(parse_effective_ids(status), Some((42101, 42102)));
        assert_eq!(parse_effective_ids("Uid:\t0\n"), None);
    }

    #[test]
    fn this_process_is_visible() {
        let me = std::process::id();
        assert!(pids().contains(&me));
        assert!(owner(me).is_some());
        assert!(exe(me).starts_with('/'));
        assert!(cgroup(me).starts_with('/'));
        assert!(!holds_device(me, &["/dev/infiniband/uverbs".into()]));
        assert!(netns("self").is_some());
        let Seen::Alive { uid, cgroup, .. } = seen(me) else {
            panic!("{:?}", seen(me));
        };
        // SAFETY: geteuid cannot fail.
        assert_eq!(uid, unsafe { libc::geteuid() });
        assert_eq!(cgroup, super::cgroup(me));
        // Pid numbers stop below 2^22 on Linux.
        assert_eq!(seen(u32::MAX >> 1), Seen::Gone);
    }
}
