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
    fn this_process_is_visible() {
        let me = std::process::id();
        assert!(pids().contains(&me));
        assert!(owner(me).is_some());
        assert!(exe(me).starts_with('/'));
        assert!(cgroup(me).starts_with('/'));
        assert!(!holds_device(me, &["/dev/infiniband/uverbs".into()]));
        assert!(netns("self").is_some());
    }
}
