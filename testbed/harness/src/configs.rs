//! The configuration files of a cluster's coordinator and agents: pure text from the
//! cluster's layout, so that what `cluster up` writes is unit-tested without processes.

use std::net::Ipv4Addr;
use std::path::Path;

/// The coordinator's QUIC port and admin endpoint. The coordinator runs on the first host,
/// in its network namespace, so every agent reaches it over the emulated network, and its
/// admin endpoint is that namespace's loopback (unauthenticated, as in production).
pub const COORDINATOR_PORT: u16 = 7400;
pub const ADMIN: &str = "127.0.0.1:9464";
/// The agents' DASR port in Dart's experiments (every agent listens on its host's address).
pub const DASR_PORT: u16 = 7410;
/// `softrnic up`'s default QP-context cache.
const SOFTRNIC_QP_CACHE: u64 = 20;
/// `softrnic up`'s default cost of a QP-context cache miss, in ns.
const SOFTRNIC_QP_MISS_NS: u64 = 1000;
/// `softrnic up`'s default cost of fetching a WQE, in ns.
const SOFTRNIC_WQE_FETCH_NS: u64 = 500;
/// `softrnic up`'s default MTU.
const SOFTRNIC_MTU: u64 = 4096;
/// What each softrnic packet adds on the wire: its 48-byte header and the 42 bytes of
/// Ethernet, IPv4 and UDP it charges (softrnic's `wire::HDR_LEN + nic::L2_L4_OVERHEAD`).
pub const SOFTRNIC_PACKET_OVERHEAD: u32 = 90;
/// The shim's gate quantum on a real NIC (1 ms) over its QP-context miss cost (≈ 0.5 µs).
const QUANTUM_PER_MISS: u64 = 2000;

/// What the configuration of one cluster depends on.
pub struct Layout<'a> {
    /// Host names, in order (`h1`, `h2`, …), with their addresses.
    pub hosts: &'a [(String, Ipv4Addr)],
    /// The emulated NICs' line rate, which each agent reports for its host.
    pub line_rate_gbps: f64,
    /// Each agent's budget of QPs with work on the NIC ([`Layout::qp_budget_for`]; 0: none).
    pub qp_budget: u64,
    /// How long a QP keeps its gate slot while others wait ([`Layout::gate_quantum_us_for`]).
    pub gate_quantum_us: u64,
    /// The emulated NICs' MTU ([`Layout::mtu`]): with [`SOFTRNIC_PACKET_OVERHEAD`], what the
    /// agents count a payload byte as on the wire.
    pub mtu: u64,
    /// What fetching a WQE costs the emulated NIC ([`Layout::wqe_fetch_ns`]), on the same
    /// clock as its packets: the agents count it as NIC time.
    pub wqe_fetch_ns: u64,
    /// The state directory (absolute), where certificates and sockets live.
    pub dir: &'a Path,
}

impl Layout<'_> {
    /// The address agents reach the coordinator at.
    pub fn coordinator(&self) -> String {
        format!("{}:{COORDINATOR_PORT}", self.hosts[0].1)
    }

    pub fn coordinator_toml(&self) -> String {
        format!(
            "# drum-testbed cluster: the coordinator, on {first}.\n\
             listen = \"0.0.0.0:{COORDINATOR_PORT}\"\n\
             admin_listen = \"{ADMIN}\"\n\
             min_members = {n}\n\
             [tls]\n\
             ca = \"certs/ca.pem\"\n\
             cert = \"certs/coordinator.pem\"\n\
             key = \"certs/coordinator.key\"\n",
            first = self.hosts[0].0,
            n = self.hosts.len(),
        )
    }

    /// The agent of `host`: joins the coordinator with its NIC's line rate (its GIDs are
    /// the host's addresses, which it finds in its namespace) and serves its shims on
    /// [`shim_socket`](Self::shim_socket).
    pub fn agent_toml(&self, host: &str) -> String {
        format!(
            "# drum-testbed cluster: the agent of {host}.\n\
             host = \"{host}\"\n\
             coordinator = \"{coordinator}\"\n\
             server_name = \"localhost\"\n\
             rate_table = \"{host}/rates.json\"\n\
             [tls]\n\
             ca = \"certs/ca.pem\"\n\
             cert = \"certs/agent-{host}.pem\"\n\
             key = \"certs/agent-{host}.key\"\n\
             [shim]\n\
             socket = \"{host}/shim.sock\"\n\
             line_rate_gbps = {rate}\n\
             qp_budget = {qps}\n\
             quantum_us = {quantum}\n\
             mtu = {mtu}\n\
             packet_overhead_bytes = {SOFTRNIC_PACKET_OVERHEAD}\n\
             wqe_cost_ns = {fetch}\n\
             # Programs on this host that use the NIC without the shim (docs/tenants.md): the\n\
             # hosts share one kernel, so only this host's network namespace, and softrnic's\n\
             # per-process counters say what they send.\n\
             [shim.ungoverned]\n\
             same_netns = true\n\
             nic_counters = {counters:?}\n",
            coordinator = self.coordinator(),
            rate = self.line_rate_gbps,
            qps = self.qp_budget,
            quantum = self.gate_quantum_us,
            mtu = self.mtu,
            fetch = self.wqe_fetch_ns,
            counters = self.dir.join("softrnic/hosts").join(host).join("stats"),
        )
    }

    /// The agent of `host` at `ip` for Dart's experiments: no coordinator (`drum-agent
    /// --local`), its shims' link and a DASR channel on the host's address at [`DASR_PORT`]
    /// (the port the agents announce to, docs/dasr.md), receivers' rate the line rate.
    /// Sends of 64 KiB and more count as long messages: Dart's are 64 and 256 KiB.
    pub fn dasr_agent_toml(&self, host: &str, ip: Ipv4Addr) -> String {
        format!(
            "# drum-testbed, Dart's experiments: the agent of {host}, local, with DASR.\n\
             status_file = \"{host}/status.json\"\n\
             [shim]\n\
             socket = \"{host}/shim.sock\"\n\
             line_rate_gbps = {rate}\n\
             long_msg_bytes = 65536\n\
             mtu = {mtu}\n\
             packet_overhead_bytes = {SOFTRNIC_PACKET_OVERHEAD}\n\
             [dasr]\n\
             listen = \"{ip}:{DASR_PORT}\"\n\
             expiry_ms = 500\n",
            rate = self.line_rate_gbps,
            mtu = self.mtu,
        )
    }

    /// The QP-context cache `softrnic up` gets from `args` (`--qp-cache N`, else softrnic's
    /// default of 20): what an operator would tell the agent of its NIC.
    pub fn qp_cache(args: &[String]) -> Result<u64, String> {
        softrnic_number(args, "--qp-cache", SOFTRNIC_QP_CACHE)
    }

    /// The WQE fetch cost `softrnic up` gets from `args` (`--wqe-fetch-ns`).
    pub fn wqe_fetch_ns(args: &[String]) -> Result<u64, String> {
        softrnic_number(args, "--wqe-fetch-ns", SOFTRNIC_WQE_FETCH_NS)
    }

    /// The MTU `softrnic up` gets from `args` (`--mtu`).
    pub fn mtu(args: &[String]) -> Result<u64, String> {
        softrnic_number(args, "--mtu", SOFTRNIC_MTU)
    }

    /// The cost of a QP-context miss `softrnic up` gets from `args` (`--qp-miss-ns`).
    pub fn qp_miss_ns(args: &[String]) -> Result<u64, String> {
        softrnic_number(args, "--qp-miss-ns", SOFTRNIC_QP_MISS_NS)
    }

    /// The shims' gate quantum for a NIC whose QP-context miss costs `miss_ns`: the ratio a
    /// real NIC has to the shim's default (1 ms against ≈ 0.5 µs), at least that default.
    /// Every hand-over of a slot costs a miss on both NICs, so on a time-dilated NIC an
    /// undilated quantum spends the NIC on misses: a 64-QP `ib_write_bw` of 1 KiB gated to
    /// 10 slots next to a bandwidth victim caused 49,245 misses on the responder in 8 s with
    /// 1 ms on the dilated NIC (100 µs a miss), 1,562 with 200 ms (2026-11-26).
    pub fn gate_quantum_us_for(miss_ns: u64) -> u64 {
        (miss_ns.saturating_mul(QUANTUM_PER_MISS) / 1000).max(1000)
    }

    /// The agents' QP budget for a QP-context cache of `cache`: half of it. A gate as large
    /// as the cache still thrashes it, since a QP that hands its slot on still has packets
    /// and acknowledgements of its last work passing through the NIC: on the dilated NIC
    /// (cache 20) a 64-QP `ib_write_bw` of 1 KiB under DRUM alone missed on 44 % of cache
    /// lookups with a gate of 20, 40 % with 16, 0.5 % with 10 (2026-11-26, `softrnic stats`).
    pub fn qp_budget_for(cache: u64) -> u64 {
        cache / 2
    }

    /// Where the agent of `host` writes its rate table (docs/control-plane.md).
    pub fn rate_table(dir: &Path, host: &str) -> std::path::PathBuf {
        dir.join(host).join("rates.json")
    }

    /// Where the shims of `host` register with its agent.
    pub fn shim_socket(&self, host: &str) -> std::path::PathBuf {
        self.dir.join(host).join("shim.sock")
    }
}

/// The value of `softrnic up`'s option `name` in `args` (`--name N` or `--name=N`), else
/// `default`.
fn softrnic_number(args: &[String], name: &str, default: u64) -> Result<u64, String> {
    let mut value = None;
    for (i, a) in args.iter().enumerate() {
        if let Some(v) = a.strip_prefix(name).and_then(|v| v.strip_prefix('=')) {
            value = Some(v.to_string());
        } else if a == name {
            value = Some(args.get(i + 1).cloned().unwrap_or_default());
        }
    }
    value.map_or(Ok(default), |v| {
        v.parse()
            .map_err(|_| format!("{name} wants a whole number, got {v:?}"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(dir: &Path) -> Layout<'_> {
        static HOSTS: std::sync::OnceLock<Vec<(String, Ipv4Addr)>> = std::sync::OnceLock::new();
        let hosts = HOSTS.get_or_init(|| {
            vec![
                ("h1".into(), Ipv4Addr::new(10, 77, 0, 1)),
                ("h2".into(), Ipv4Addr::new(10, 77, 0, 2)),
            ]
        });
        Layout {
            hosts,
            line_rate_gbps: 25.0,
            qp_budget: 20,
            gate_quantum_us: 1000,
            mtu: 1024,
            wqe_fetch_ns: 10_000,
            dir,
        }
    }

    #[test]
    fn agents_reach_the_coordinator_on_the_first_host() {
        let l = layout(Path::new("/run/x"));
        assert_eq!(l.coordinator(), "10.77.0.1:7400");
        assert!(l
            .agent_toml("h2")
            .contains("coordinator = \"10.77.0.1:7400\"\n"));
        assert!(l.coordinator_toml().contains("min_members = 2\n"));
    }

    #[test]
    fn the_agents_qp_budget_is_the_nics_cache() {
        let args = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(Layout::qp_cache(&args(&["--loss", "0.01"])), Ok(20));
        assert_eq!(Layout::qp_cache(&args(&["--qp-cache", "64"])), Ok(64));
        assert_eq!(Layout::qp_cache(&args(&["--qp-cache=0"])), Ok(0));
        assert_eq!(Layout::qp_budget_for(20), 10);
        assert!(Layout::qp_cache(&args(&["--qp-cache"])).is_err());
    }

    #[test]
    fn the_gate_quantum_follows_the_nics_miss_cost() {
        let args = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(Layout::qp_miss_ns(&args(&[])), Ok(1000));
        assert_eq!(
            Layout::qp_miss_ns(&args(&["--qp-miss-ns=100000"])),
            Ok(100_000)
        );
        assert!(Layout::qp_miss_ns(&args(&["--qp-miss-ns", "x"])).is_err());
        assert_eq!(Layout::gate_quantum_us_for(100_000), 200_000);
        assert_eq!(Layout::gate_quantum_us_for(500), 1000);
        assert_eq!(Layout::gate_quantum_us_for(0), 1000);
        assert_eq!(Layout::gate_quantum_us_for(u64::MAX), u64::MAX / 1000);
    }

    #[test]
    fn each_agent_has_its_own_certificate_and_socket() {
        let l = layout(Path::new("/run/x"));
        let a = l.agent_toml("h2");
        for want in [
            "host = \"h2\"\n",
            "cert = \"certs/agent-h2.pem\"\n",
            "socket = \"h2/shim.sock\"\n",
            "rate_table = \"h2/rates.json\"\n",
            "line_rate_gbps = 25\n",
            "qp_budget = 20\n",
            "quantum_us = 1000\n",
            "mtu = 1024\n",
            "packet_overhead_bytes = 90\n",
            "wqe_cost_ns = 10000\n",
            "nic_counters = \"/run/x/softrnic/hosts/h2/stats\"\n",
        ] {
            assert!(a.contains(want), "{want} in {a}");
        }
        assert_eq!(l.shim_socket("h2"), Path::new("/run/x/h2/shim.sock"));
    }

    #[test]
    fn dart_agents_listen_for_dasr_on_their_hosts_address() {
        let l = layout(Path::new("/run/x"));
        let a = l.dasr_agent_toml("h2", Ipv4Addr::new(10, 77, 0, 2));
        for want in [
            "socket = \"h2/shim.sock\"\n",
            "line_rate_gbps = 25\n",
            "long_msg_bytes = 65536\n",
            "mtu = 1024\n",
            "[dasr]\nlisten = \"10.77.0.2:7410\"\n",
        ] {
            assert!(a.contains(want), "{want} in {a}");
        }
        assert!(!a.contains("coordinator"));
    }
}
