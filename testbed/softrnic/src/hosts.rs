//! Emulated hosts: the run directory, `up`, `down`, `exec` and `addr`.
//!
//! Layout of a run directory:
//! ```text
//! <run>/state                      hosts, mode, namespace names, engine pids
//! <run>/lib/libsoftrnic-rdmav34.so symlink to the provider next to the softrnic binary
//! <run>/hosts/<h>/sys/...          the generated sysfs tree of host <h> (SYSFS_PATH)
//! <run>/hosts/<h>/engine.sock      the engine's verbs socket
//! <run>/hosts/<h>/doorbell         the engine's doorbell page (see crate::ring)
//! <run>/hosts/<h>/engine.log       the engine's output
//! <run>/hosts/<h>/stats            the engine's counters (`name value` lines)
//! <run>/faults                     fault injection settings read by the engines
//! <run>/nic                        NIC model settings read by the engines
//! <run>/holder.log                 without root: the namespace holder's output
//! <run>/devstage                   without root: where `exec` stages a rebuilt /dev
//! ```
//!
//! As root, hosts are network namespaces named `srn<tag>-h<i>` in /run/netns; as another user,
//! they live in the user namespace of a holder process (see `crate::userns`).

use std::ffi::CString;
use std::fs;
use std::net::Ipv4Addr;
use std::os::unix::fs::symlink;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use crate::dart_receiver::Policy;

use crate::devdir::{self, DEVDIR};
use crate::faults::{FaultConfig, Faults, LinkSpec};
use crate::nic::NicConfig;
use crate::{device, userns};

/// Where /dev/infiniband users are counted (one file per run directory using it).
const DEVDIR_USERS: &str = "/run/softrnic.devdir-users";
const SUBNET: [u8; 3] = [10, 77, 0];

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Host {
    pub name: String,
    pub ip: Ipv4Addr,
    /// Network namespace: a name under /run/netns (root), a path `/proc/HOLDER/fd/N`
    /// (without root), or None in loopback mode.
    pub netns: Option<String>,
    pub engine_pid: i32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunState {
    pub tag: String,
    pub hosts: Vec<Host>,
    pub switch_netns: Option<String>,
    /// Without root: the pid of the process holding the run's user namespace.
    pub holder: Option<i32>,
}

impl RunState {
    pub fn encode(&self) -> String {
        let mut s = format!("tag {}\n", self.tag);
        if let Some(sw) = &self.switch_netns {
            s.push_str(&format!("switch {sw}\n"));
        }
        if let Some(pid) = self.holder {
            s.push_str(&format!("holder {pid}\n"));
        }
        for h in &self.hosts {
            s.push_str(&format!(
                "host {} {} {} {}\n",
                h.name,
                h.ip,
                h.netns.as_deref().unwrap_or("-"),
                h.engine_pid
            ));
        }
        s
    }

    pub fn decode(s: &str) -> Result<Self> {
        let mut st = RunState {
            tag: String::new(),
            hosts: Vec::new(),
            switch_netns: None,
            holder: None,
        };
        for line in s.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            match f.as_slice() {
                ["tag", t] => st.tag = t.to_string(),
                ["switch", s] => st.switch_netns = Some(s.to_string()),
                ["holder", pid] => st.holder = Some(pid.parse()?),
                ["host", n, ip, ns, pid] => st.hosts.push(Host {
                    name: n.to_string(),
                    ip: ip.parse()?,
                    netns: (*ns != "-").then(|| ns.to_string()),
                    engine_pid: pid.parse()?,
                }),
                [] => {}
                _ => bail!("bad state line: {line}"),
            }
        }
        Ok(st)
    }
}

/// The run directory: --run-dir, else $SOFTRNIC_RUN_DIR, else /run/softrnic.
pub fn run_dir(arg: Option<PathBuf>) -> PathBuf {
    arg.or_else(|| std::env::var_os("SOFTRNIC_RUN_DIR").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from("/run/softrnic"))
}

/// Short tag unique to a run directory (names its namespaces and loopback addresses).
pub fn tag_for(run: &Path) -> String {
    let abs = std::path::absolute(run).unwrap_or_else(|_| run.to_path_buf());
    // FNV-1a, 24 bits shown.
    let mut h: u32 = 0x811c_9dc5;
    for b in abs.as_os_str().as_encoded_bytes() {
        h ^= *b as u32;
        h = h.wrapping_mul(0x0100_0193);
    }
    format!("{:06x}", h & 0xff_ffff)
}

/// Loopback address of host `i` (1-based) in loopback mode: 127.a.b.i, a/b from the tag.
fn loopback_ip(tag: &str, i: usize) -> Ipv4Addr {
    let v = u32::from_str_radix(tag, 16).unwrap_or(1);
    let a = ((v >> 8) & 0xff) as u8 | 1; // never 127.0.x.x (127.0.0.1 is often special)
    let b = (v & 0xff) as u8;
    Ipv4Addr::new(127, a, b, i as u8)
}

fn state_path(run: &Path) -> PathBuf {
    run.join("state")
}

pub fn load_state(run: &Path) -> Result<RunState> {
    let p = state_path(run);
    let s = fs::read_to_string(&p)
        .with_context(|| format!("{} (is `softrnic up` running?)", p.display()))?;
    RunState::decode(&s)
}

fn sh(cmd: &str, args: &[&str]) -> Result<()> {
    run_checked(Command::new(cmd).args(args))
}

/// Run a helper command (`ip`) to completion; its stderr is the error if it fails.
pub(crate) fn run_checked(cmd: &mut Command) -> Result<()> {
    let line = std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ");
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {line}"))?;
    if !out.status.success() {
        bail!("{line}: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

/// Address of host `i` (1-based) in network-namespace mode.
pub fn netns_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(SUBNET[0], SUBNET[1], SUBNET[2], i as u8)
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Whether this process may create network namespaces and veth links (without root, in the
/// holder's user namespace).
pub fn can_netns() -> bool {
    (!is_root() || Path::new("/run").exists()) && which("ip")
}

fn which(cmd: &str) -> bool {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(cmd).is_file()))
        .unwrap_or(false)
}

/// The file the `softrnic-provider` crate builds.
const PROVIDER_FILE: &str = "libsoftrnic_provider.so";

/// The provider library next to the running binary.
fn provider_lib() -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let p = exe
        .parent()
        .ok_or_else(|| anyhow!("binary has no directory"))?
        .join(PROVIDER_FILE);
    if !p.exists() {
        bail!(
            "provider {} not found (build it with `cargo build -p softrnic-provider`, the same \
             profile as this binary)",
            p.display()
        );
    }
    Ok(p)
}

/// The network device of a host in its own namespace (the veth end that holds its address).
pub const NETDEV: &str = "eth0";
/// A host on a loopback address has the loopback device.
const LOOPBACK_NETDEV: &str = "lo";

/// Write the sysfs tree libibverbs reads for one host: `devices` devices, functions of its
/// one NIC (one engine, one port, one GID), told apart by their names, uverbs nodes and GUIDs;
/// `netdev` is the network device its address is on (the RoCE port's netdev);
/// `auss_table`, the engine's AUSS table when the run has AUSS on.
pub fn write_sysfs(
    root: &Path,
    ip: Ipv4Addr,
    engine_socket: &Path,
    mtu: u32,
    devices: usize,
    netdev: &str,
    auss_table: Option<&Path>,
) -> Result<()> {
    let verbs = root.join("class/infiniband_verbs");
    let port = device::port_dir(root);
    for d in [
        &verbs,
        &port.join("gids"),
        &port.join("gid_attrs/types"),
        &port.join("gid_attrs/ndevs"),
        &port.join("pkeys"),
    ] {
        fs::create_dir_all(d)?;
    }
    let w = |p: PathBuf, s: &str| fs::write(&p, s).with_context(|| p.display().to_string());
    w(
        verbs.join("abi_version"),
        &format!("{}\n", device::UVERBS_ABI),
    )?;
    // librdmacm reads the RDMA CM's ABI version here when RDMA netlink is not there.
    let cm = root.join("class/misc/rdma_cm");
    fs::create_dir_all(&cm)?;
    w(
        cm.join("abi_version"),
        &format!("{}\n", crate::device::RDMA_CM_ABI_VERSION),
    )?;
    for i in 0..devices {
        let uv = verbs.join(device::uverbs_name(i));
        let ib = root.join("class/infiniband").join(device::ibdev_name(i));
        fs::create_dir_all(&uv)?;
        fs::create_dir_all(&ib)?;
        w(uv.join("ibdev"), &format!("{}\n", device::ibdev_name(i)))?;
        // The numbers of the node `exec` puts at /dev/infiniband/uverbsN: libibverbs opens
        // the device only if they match, and ibv_import_device finds it by them.
        let (major, minor) = devdir::NODE_DEV;
        w(uv.join("dev"), &format!("{major}:{minor}\n"))?;
        w(uv.join("abi_version"), &format!("{}\n", device::UVERBS_ABI))?;
        w(ib.join("node_type"), "1: CA\n")?;
        // Where a PCI NIC's directory lists its netdevs (pyverbs' RDMA CM tests look here).
        fs::create_dir_all(ib.join("device/net").join(netdev))?;
        let guid = device::guid_sysfs(device::device_guid(ip, i));
        w(ib.join("node_guid"), &format!("{guid}\n"))?;
        let image = device::guid_sysfs(device::node_guid(ip));
        w(ib.join("sys_image_guid"), &format!("{image}\n"))?;
        w(ib.join("fw_ver"), &format!("{}\n", device::FW_VER))?;
        w(ib.join("hca_type"), "softrnic\n")?;
        w(ib.join("board_id"), "SOFTRNIC-0001\n")?;
        w(
            ib.join("softrnic_engine_socket"),
            &format!("{}\n", engine_socket.display()),
        )?;
        // The port MTU of the NIC model (bytes), reported by query_port as the active MTU.
        w(ib.join("softrnic_mtu"), &format!("{mtu}\n"))?;
        // Where a program finds each destination's N (drum_table::nic_auss): a preloaded
        // shim looks for this file next to softrnic_engine_socket, in the device's
        // ibdev_path; without it the NIC has no AUSS.
        if let Some(t) = auss_table {
            w(ib.join("softrnic_auss"), &format!("{}\n", t.display()))?;
        }
        if i > 0 {
            // The NIC's one port: its state (which `link` writes) is every device's.
            symlink(format!("../{}/ports", device::IBDEV_NAME), ib.join("ports"))?;
        }
    }
    let gid = device::gid_sysfs(&device::gid_for(ip));
    w(port.join("gids/0"), &format!("{gid}\n"))?;
    w(port.join("gid_attrs/types/0"), "RoCE v2\n")?;
    w(port.join("gid_attrs/ndevs/0"), &format!("{netdev}\n"))?;
    w(port.join("pkeys/0"), "0xffff\n")?;
    write_port_state(&port, true)?;
    w(port.join("link_layer"), "Ethernet\n")?;
    w(port.join("lid"), "0x0\n")?;
    w(port.join("rate"), "25 Gb/sec (1X EDR)\n")?;
    Ok(())
}

fn write_port_state(port: &Path, up: bool) -> Result<()> {
    let (state, phys) = device::port_state_text(up);
    for (f, s) in [("phys_state", phys), ("state", state)] {
        let p = port.join(f);
        fs::write(&p, s).with_context(|| p.display().to_string())?;
    }
    Ok(())
}

/// The port `state` file of host `name`'s device, which its engine watches.
pub fn port_state_path(host_dir: &Path) -> PathBuf {
    device::port_dir(&host_dir.join("sys")).join("state")
}

/// Take host `name`'s link down or bring it up, as pulling or plugging its cable would: the
/// port's sysfs state changes at once; within [`crate::engine::PORT_CHECK_EVERY`] the engine
/// stops (or resumes) sending and receiving and raises `IBV_EVENT_PORT_ERR` (or
/// `IBV_EVENT_PORT_ACTIVE`) on every open context of the host.
pub fn set_link(run: &Path, name: &str, up: bool) -> Result<()> {
    let st = load_state(run)?;
    if !st.hosts.iter().any(|h| h.name == name) {
        bail!("no host {name} (hosts: {})", host_names(&st));
    }
    let dir = run.join("hosts").join(name);
    write_port_state(&device::port_dir(&dir.join("sys")), up)
}

/// Sets how host `name`'s NIC answers ECN-marked packets (see [`crate::dart_receiver`]);
/// its engine applies it within [`crate::engine::PORT_CHECK_EVERY`] and shows it as
/// `dart_receiver` in its stats.
pub fn set_receiver_policy(run: &Path, name: &str, policy: Policy) -> Result<()> {
    write_setting(run, name, receiver_policy_path, policy.name())
}

/// Sets whether host `name`'s NIC caps its RC QPs at `R/N` of their destinations' stamps;
/// applied and shown (`dasr_caps`) as [`set_receiver_policy`] is.
pub fn set_dasr_caps(run: &Path, name: &str, on: bool) -> Result<()> {
    write_setting(run, name, dasr_caps_path, if on { "on" } else { "off" })
}

fn write_setting(run: &Path, name: &str, file: fn(&Path) -> PathBuf, value: &str) -> Result<()> {
    let st = load_state(run)?;
    if !st.hosts.iter().any(|h| h.name == name) {
        bail!("no host {name} (hosts: {})", host_names(&st));
    }
    let path = file(&run.join("hosts").join(name));
    // Whole or not at all: the engine must never read half a word.
    let tmp = path.with_extension("tmp");
    fs::write(&tmp, format!("{value}\n"))
        .and_then(|()| fs::rename(&tmp, &path))
        .with_context(|| format!("writing {}", path.display()))
}

/// The file a host's engine reads whether to cap its QPs at `R/N` from.
pub fn dasr_caps_path(host_dir: &Path) -> PathBuf {
    host_dir.join("dasr")
}

/// The file a host's engine reads its receiver policy from.
pub fn receiver_policy_path(host_dir: &Path) -> PathBuf {
    host_dir.join("receiver")
}

/// Whether `pid` is this run's `role` process ("engine" or "holder"), by its command line.
pub fn pid_is_ours(pid: i32, run: &Path, role: &str) -> bool {
    if pid <= 0 {
        return false;
    }
    match fs::read(format!("/proc/{pid}/cmdline")) {
        // Whole arguments, not substrings: run directories may be prefixes of one another
        // (`…/pingpong` and `…/pingpong-events`), and `down` must not kill a neighbour's engines.
        Ok(c) => {
            let args: Vec<&[u8]> = c.split(|&b| b == 0).collect();
            let run = run.as_os_str().as_encoded_bytes();
            args.windows(3)
                .any(|w| w[0] == b"--run-dir" && w[1] == run && w[2] == role.as_bytes())
        }
        Err(_) => false,
    }
}

fn kill_ours(pid: i32, run: &Path, role: &str) {
    if !pid_is_ours(pid, run, role) {
        return;
    }
    // SAFETY: kill has no memory-safety preconditions; pid was checked to be our process.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let t = Instant::now();
    while pid_is_ours(pid, run, role) && t.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(10));
    }
    if pid_is_ours(pid, run, role) {
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
}

/// Tear down everything of a run directory, including leftovers of a crashed run.
pub fn down(run: &Path) -> Result<()> {
    let run = &std::path::absolute(run)?;
    let tag = tag_for(run);
    if let Ok(st) = load_state(run) {
        for h in &st.hosts {
            kill_ours(h.engine_pid, run, "engine");
        }
        // Without root, the holder's namespaces go with it (its engines are gone).
        if let Some(pid) = st.holder {
            kill_ours(pid, run, "holder");
        }
    }
    // Engines and holders whose pid never made it into the state file (crash during up).
    if let Ok(rd) = fs::read_dir("/proc") {
        for e in rd.flatten() {
            if let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() {
                for role in ["engine", "holder"] {
                    if pid != std::process::id() as i32 && pid_is_ours(pid, run, role) {
                        kill_ours(pid, run, role);
                    }
                }
            }
        }
    }
    // Namespaces named after this run's tag (veths die with their namespaces).
    if let Ok(rd) = fs::read_dir("/run/netns") {
        for e in rd.flatten() {
            let n = e.file_name().to_string_lossy().to_string();
            if n.starts_with(&format!("srn{tag}-")) {
                let _ = sh("ip", &["netns", "del", &n]);
            }
        }
    }
    release_devdir(&tag);
    if run.exists() {
        fs::remove_dir_all(run).with_context(|| format!("removing {}", run.display()))?;
    }
    Ok(())
}

/// An exclusive `flock` on the directory `/run` (released when dropped; nothing is created):
/// concurrent runs (tests run in parallel) must not interleave counting /dev/infiniband's
/// users, or one could remove the directory while another is adding itself.
fn devdir_lock() -> Option<fs::File> {
    use std::os::fd::AsRawFd;
    let f = fs::File::open("/run").ok()?;
    // SAFETY: flock on a file descriptor we own; released when the file is closed.
    unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
    Some(f)
}

/// Make sure the mount point /dev/infiniband exists while any run uses it.
fn acquire_devdir(tag: &str) -> Result<()> {
    let _lock = devdir_lock();
    fs::create_dir_all(DEVDIR_USERS)?;
    if !Path::new(DEVDIR).exists() {
        fs::create_dir(DEVDIR).context("creating /dev/infiniband")?;
        fs::write(Path::new(DEVDIR_USERS).join(".created"), "")?;
    }
    fs::write(Path::new(DEVDIR_USERS).join(tag), "")?;
    Ok(())
}

fn release_devdir(tag: &str) {
    let _lock = devdir_lock();
    let users = Path::new(DEVDIR_USERS);
    let _ = fs::remove_file(users.join(tag));
    let others = fs::read_dir(users)
        .map(|rd| {
            rd.flatten()
                .any(|e| !e.file_name().to_string_lossy().starts_with('.'))
        })
        .unwrap_or(false);
    if !others && users.join(".created").exists() {
        // Only an empty directory we created ourselves is removed.
        let _ = fs::remove_dir(DEVDIR);
        let _ = fs::remove_file(users.join(".created"));
        let _ = fs::remove_dir(users);
    } else if !others {
        let _ = fs::remove_dir(users);
    }
}

/// Fault injection requested at `up`: a seed, the faults of every link, per-link overrides
/// (by host name).
#[derive(Debug, Clone, Default)]
pub struct UpFaults {
    pub seed: u64,
    pub default: Faults,
    pub links: Vec<LinkSpec>,
}

/// Resolve link overrides given by host names to the engines' (host, address) form.
fn resolve_faults(f: &UpFaults, hosts: &[Host]) -> Result<FaultConfig> {
    let ip_of = |n: &str| {
        hosts
            .iter()
            .find(|h| h.name == n)
            .map(|h| h.ip)
            .ok_or_else(|| anyhow!("--link-faults names unknown host {n}"))
    };
    let mut c = FaultConfig {
        seed: f.seed,
        default: f.default,
        links: Vec::new(),
    };
    for l in &f.links {
        ip_of(&l.src)?;
        c.links.push((l.src.clone(), ip_of(&l.dst)?, l.faults));
    }
    Ok(c)
}

pub fn stats_path(run: &Path, host: &str) -> PathBuf {
    run.join("hosts").join(host).join("stats")
}

/// The counters of host `name`'s engine.
pub fn stats(run: &Path, name: &str) -> Result<String> {
    let st = load_state(run)?;
    if !st.hosts.iter().any(|h| h.name == name) {
        bail!("no host {name} (hosts: {})", host_names(&st));
    }
    let p = stats_path(run, name);
    fs::read_to_string(&p).with_context(|| format!("{}", p.display()))
}

/// Host `name`'s AUSS table, found as a program finds it (the device's `softrnic_auss`
/// file): `destination n epoch incarnation age_ms` lines.
pub fn auss(run: &Path, name: &str) -> Result<String> {
    let st = load_state(run)?;
    if !st.hosts.iter().any(|h| h.name == name) {
        bail!("no host {name} (hosts: {})", host_names(&st));
    }
    let f = run
        .join("hosts")
        .join(name)
        .join("sys/class/infiniband")
        .join(device::IBDEV_NAME)
        .join("softrnic_auss");
    let table = fs::read_to_string(&f)
        .with_context(|| format!("{} (is the run up with --auss-expiry-ms?)", f.display()))?;
    let r = drum_table::nic_auss::Reader::open(Path::new(table.trim()))
        .with_context(|| table.trim().to_string())?;
    let now = drum_table::nic_auss::monotonic_ns();
    Ok(r.entries()
        .iter()
        .map(|e| {
            format!(
                "{} {} {} {} {}\n",
                e.ip,
                e.n,
                e.epoch,
                e.incarnation,
                now.saturating_sub(e.updated_ns) / 1_000_000
            )
        })
        .collect())
}

/// As root: the switch namespace `srn<tag>-sw` with a bridge, and one namespace per host
/// (`srn<tag>-h<i>`, address `netns_ip(i)`) linked to it by a veth pair; returns their names.
fn root_namespaces(tag: &str, n: usize) -> Result<Vec<String>> {
    let sw = format!("srn{tag}-sw");
    sh("ip", &["netns", "add", &sw])?;
    sh("ip", &["-n", &sw, "link", "add", "br0", "type", "bridge"])?;
    sh("ip", &["-n", &sw, "link", "set", "br0", "up"])?;
    let mut names = Vec::new();
    for i in 1..=n {
        let ns = format!("srn{tag}-h{i}");
        sh("ip", &["netns", "add", &ns])?;
        let port = format!("p{i}");
        sh(
            "ip",
            &[
                "-n", &sw, "link", "add", &port, "mtu", "9000", "type", "veth", "peer", "name",
                NETDEV, "mtu", "9000", "netns", &ns,
            ],
        )?;
        sh("ip", &["-n", &sw, "link", "set", &port, "master", "br0"])?;
        sh("ip", &["-n", &sw, "link", "set", &port, "up"])?;
        let addr = format!("{}/24", netns_ip(i));
        sh("ip", &["-n", &ns, "addr", "add", &addr, "dev", NETDEV])?;
        sh("ip", &["-n", &ns, "link", "set", NETDEV, "up"])?;
        sh("ip", &["-n", &ns, "link", "set", "lo", "up"])?;
        names.push(ns);
    }
    Ok(names)
}

/// Bring up `n` hosts. `loopback` forces loopback mode even when namespaces are possible.
pub fn up(
    run: &Path,
    n: usize,
    devices: usize,
    loopback: bool,
    faults: &UpFaults,
    nic: &NicConfig,
    gso: bool,
) -> Result<RunState> {
    if n == 0 || n > 200 {
        bail!("--hosts must be between 1 and 200");
    }
    if devices == 0 || devices > device::MAX_DEVICES {
        bail!("--devices must be between 1 and {}", device::MAX_DEVICES);
    }
    nic.validate()?;
    for l in &faults.links {
        for h in [&l.src, &l.dst] {
            let ok = h
                .strip_prefix('h')
                .and_then(|i| i.parse::<usize>().ok())
                .is_some_and(|i| (1..=n).contains(&i));
            if !ok {
                bail!("--link-faults names unknown host {h} (hosts are h1..h{n})");
            }
        }
    }
    down(run)?;
    let run = std::path::absolute(run)?;
    let tag = tag_for(&run);
    fs::create_dir_all(run.join("lib")).with_context(|| {
        format!(
            "creating {} (choose a writable --run-dir or $SOFTRNIC_RUN_DIR)",
            run.display()
        )
    })?;
    fs::create_dir_all(run.join("hosts"))?;
    let lib = provider_lib()?;
    symlink(&lib, run.join("lib/libsoftrnic-rdmav34.so"))?;
    let use_netns = !loopback && can_netns();
    let mut st = RunState {
        tag: tag.clone(),
        hosts: Vec::new(),
        switch_netns: None,
        holder: None,
    };
    let res = (|| -> Result<()> {
        let netns = if is_root() {
            acquire_devdir(&tag)?;
            if use_netns {
                st.switch_netns = Some(format!("srn{tag}-sw"));
                root_namespaces(&tag, n)?
            } else {
                Vec::new()
            }
        } else {
            let (pid, paths) = userns::spawn_holder(&run, n, use_netns)?;
            st.holder = Some(pid);
            fs::write(state_path(&run), st.encode())?;
            paths
        };
        for i in 1..=n {
            st.hosts.push(Host {
                name: format!("h{i}"),
                ip: if use_netns {
                    netns_ip(i)
                } else {
                    loopback_ip(&tag, i)
                },
                netns: netns.get(i - 1).cloned(),
                engine_pid: 0,
            });
        }
        let faults_file = run.join("faults");
        fs::write(&faults_file, resolve_faults(faults, &st.hosts)?.encode())?;
        let nic_file = run.join("nic");
        fs::write(&nic_file, nic.encode())?;
        let exe = std::env::current_exe()?;
        let peers: Vec<String> = st.hosts.iter().map(|h| h.ip.to_string()).collect();
        for i in 0..st.hosts.len() {
            let h = st.hosts[i].clone();
            let dir = run.join("hosts").join(&h.name);
            fs::create_dir_all(&dir)?;
            let sock = dir.join("engine.sock");
            let netdev = if use_netns { NETDEV } else { LOOPBACK_NETDEV };
            let auss = nic.auss_expiry().map(|_| dir.join("auss"));
            write_sysfs(
                &dir.join("sys"),
                h.ip,
                &sock,
                nic.mtu,
                devices,
                netdev,
                auss.as_deref(),
            )?;
            let log = fs::File::create(dir.join("engine.log"))?;
            let mut cmd = Command::new(&exe);
            cmd.arg("--run-dir")
                .arg(&run)
                .arg("engine")
                .arg("--host")
                .arg(&h.name)
                .arg("--ip")
                .arg(h.ip.to_string())
                .arg("--socket")
                .arg(&sock)
                .arg("--faults")
                .arg(&faults_file)
                .arg("--stats")
                .arg(stats_path(&run, &h.name))
                .arg("--nic")
                .arg(&nic_file)
                .arg("--peers")
                .arg(peers.join(","));
            if let Some(ns) = &h.netns {
                cmd.arg("--netns").arg(ns);
            }
            if let Some(pid) = st.holder {
                cmd.arg("--holder").arg(pid.to_string());
            }
            if !gso {
                cmd.arg("--no-gso");
            }
            cmd.stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log);
            // SAFETY: setsid is async-signal-safe; the engine leaves our session so that it
            // outlives `up` and is not hit by the terminal's signals.
            unsafe {
                cmd.pre_exec(|| {
                    libc::setsid();
                    Ok(())
                });
            }
            let child = cmd.spawn().context("starting engine")?;
            st.hosts[i].engine_pid = child.id() as i32;
            fs::write(state_path(&run), st.encode())?;
            let t = Instant::now();
            while !sock.exists() {
                if t.elapsed() > Duration::from_secs(10) {
                    let log = fs::read_to_string(dir.join("engine.log")).unwrap_or_default();
                    bail!("engine of {} did not start: {log}", h.name);
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        fs::write(state_path(&run), st.encode())?;
        Ok(())
    })();
    if let Err(e) = res {
        let _ = fs::write(state_path(&run), st.encode());
        let _ = down(&run);
        return Err(e);
    }
    Ok(st)
}

fn enter_netns(ns: &str) -> Result<()> {
    let p = CString::new(format!("/run/netns/{ns}"))?;
    // SAFETY: p is a valid C string; the fd is closed after setns.
    unsafe {
        let fd = libc::open(p.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
        if fd < 0 {
            bail!("opening netns {ns}: {}", std::io::Error::last_os_error());
        }
        let r = libc::setns(fd, libc::CLONE_NEWNET);
        let e = std::io::Error::last_os_error();
        libc::close(fd);
        if r != 0 {
            bail!("setns {ns}: {e}");
        }
    }
    Ok(())
}

/// Enter a host's network namespace (engine side).
pub fn enter_host_netns(ns: &str) -> Result<()> {
    enter_netns(ns)
}

/// Replace this process with `cmd` running "on" host `name`.
pub fn exec(run: &Path, name: &str, cmd: &[String]) -> Result<()> {
    if cmd.is_empty() {
        bail!("no command given");
    }
    let run = std::path::absolute(run)?;
    let st = load_state(&run)?;
    let h = st
        .hosts
        .iter()
        .find(|h| h.name == name)
        .ok_or_else(|| anyhow!("no host {name} (hosts: {})", host_names(&st)))?;
    if let Some(holder) = st.holder {
        userns::join(&run, holder, h.netns.as_deref())?;
        devdir::private_devdir_userns(&run.join("devstage"))?;
    } else {
        if let Some(ns) = &h.netns {
            enter_netns(ns)?;
        }
        devdir::private_devdir_root()?;
    }
    let dir = run.join("hosts").join(&h.name);
    if let Err(e) = devdir::private_sysfs_class(&run.join("sysstage"), &dir.join("sys/class")) {
        // SYSFS_PATH still leads libibverbs to the device; only readers of /sys miss it.
        eprintln!("softrnic exec: the device is not shown in /sys/class: {e:#}");
    }
    // Preloaded so that its ibv_create_comp_channel interposes libibverbs' kernel command (the
    // same object libibverbs later loads as the provider). It goes after the program's own
    // preloads: it stands for the kernel, so an interposer such as DRUM's shim must see the
    // program's calls first, as it would on a real NIC.
    let provider = run.join("lib/libsoftrnic-rdmav34.so");
    let preload = match std::env::var("LD_PRELOAD") {
        Ok(p) if !p.is_empty() => format!("{p} {}", provider.display()),
        _ => provider.display().to_string(),
    };
    let err = Command::new(&cmd[0])
        .args(&cmd[1..])
        .env("LD_PRELOAD", preload)
        .env("SYSFS_PATH", dir.join("sys"))
        .env("RDMAV_DRIVERS", run.join("lib/libsoftrnic"))
        .env("SOFTRNIC_HOST", &h.name)
        .env("SOFTRNIC_HOST_IP", h.ip.to_string())
        .exec();
    Err(anyhow!("exec {}: {err}", cmd[0]))
}

fn host_names(st: &RunState) -> String {
    st.hosts
        .iter()
        .map(|h| h.name.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

pub fn addr(run: &Path, name: &str) -> Result<Ipv4Addr> {
    let st = load_state(run)?;
    st.hosts
        .iter()
        .find(|h| h.name == name)
        .map(|h| h.ip)
        .ok_or_else(|| anyhow!("no host {name} (hosts: {})", host_names(&st)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_roundtrip() {
        let st = RunState {
            tag: "abc123".into(),
            switch_netns: Some("srnabc123-sw".into()),
            holder: Some(41),
            hosts: vec![
                Host {
                    name: "h1".into(),
                    ip: Ipv4Addr::new(10, 77, 0, 1),
                    netns: Some("srnabc123-h1".into()),
                    engine_pid: 42,
                },
                Host {
                    name: "h2".into(),
                    ip: Ipv4Addr::new(127, 1, 2, 2),
                    netns: None,
                    engine_pid: 43,
                },
            ],
        };
        assert_eq!(RunState::decode(&st.encode()).unwrap(), st);
    }

    #[test]
    fn tags_and_loopback_addresses() {
        let a = tag_for(Path::new("/tmp/a"));
        let b = tag_for(Path::new("/tmp/b"));
        assert_ne!(a, b);
        assert_eq!(a.len(), 6);
        let ip = loopback_ip(&a, 3);
        assert_eq!(ip.octets()[0], 127);
        assert_eq!(ip.octets()[3], 3);
        assert_ne!(ip.octets()[1], 0);
    }

    #[test]
    fn sysfs_tree() {
        let d = std::env::temp_dir().join(format!("softrnic-sysfs-{}", std::process::id()));
        write_sysfs(
            &d,
            Ipv4Addr::new(10, 77, 0, 1),
            Path::new("/x/engine.sock"),
            2048,
            2,
            NETDEV,
            Some(Path::new("/x/auss")),
        )
        .unwrap();
        let r = |p: &str| fs::read_to_string(d.join(p)).unwrap();
        assert_eq!(r("class/infiniband/softrnic1/softrnic_auss"), "/x/auss\n");
        assert_eq!(r("class/infiniband_verbs/abi_version"), "6\n");
        assert_eq!(r("class/infiniband_verbs/uverbs0/ibdev"), "softrnic0\n");
        assert_eq!(r("class/infiniband/softrnic0/softrnic_mtu"), "2048\n");
        assert_eq!(
            r("class/infiniband/softrnic0/ports/1/gids/0"),
            "0000:0000:0000:0000:0000:ffff:0a4d:0001\n"
        );
        // A second function of the same NIC: its own name, node and GUID, the same port.
        assert_eq!(r("class/infiniband_verbs/uverbs1/ibdev"), "softrnic1\n");
        assert_eq!(
            r("class/infiniband/softrnic1/node_guid"),
            "0253:52fe:0a4d:0001\n"
        );
        assert_eq!(
            r("class/infiniband/softrnic1/ports/1/gids/0"),
            r("class/infiniband/softrnic0/ports/1/gids/0")
        );
        assert_eq!(r("class/infiniband_verbs/uverbs1/dev"), "1:7\n");
        assert_eq!(
            r("class/infiniband/softrnic0/ports/1/gid_attrs/types/0"),
            "RoCE v2\n"
        );
        assert_eq!(
            r("class/infiniband/softrnic0/ports/1/gid_attrs/ndevs/0"),
            "eth0\n"
        );
        assert!(d
            .join("class/infiniband/softrnic1/device/net/eth0")
            .is_dir());
        assert!(!d.join("class/infiniband/softrnic2").exists());
        fs::remove_dir_all(&d).unwrap();
    }
}
