//! The `softrnic` command: bring emulated hosts with software RDMA NICs up and down, and run
//! unmodified verbs programs on them.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use anyhow::Result;
use clap::{Parser, Subcommand};

use softrnic::{engine, faults, hosts, nic, userns};

#[derive(Parser)]
#[command(
    name = "softrnic",
    version,
    about = "A software RDMA NIC for stock rdma-core"
)]
struct Cli {
    /// Run directory (default: $SOFTRNIC_RUN_DIR, else /run/softrnic).
    #[arg(long, global = true)]
    run_dir: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Create hosts h1..hN, each with a NIC engine (tears down an earlier run first).
    Up {
        #[arg(long, default_value_t = 2)]
        hosts: usize,
        /// RDMA devices per host (softrnic0, softrnic1, …; at most 4): functions of the host's
        /// one NIC, sharing its engine, port and GID.
        #[arg(long, default_value_t = 1)]
        devices: usize,
        /// Use loopback addresses even where network namespaces could be created.
        #[arg(long)]
        loopback: bool,
        /// Fault injection on every link: probability that a packet is lost.
        #[arg(long, default_value_t = 0.0, value_parser = probability)]
        loss: f64,
        /// Probability that a packet is duplicated (the copy arrives up to 2 ms later).
        #[arg(long, default_value_t = 0.0, value_parser = probability)]
        dup: f64,
        /// Probability that a packet is held back 0.2-2 ms (later packets overtake it).
        #[arg(long, default_value_t = 0.0, value_parser = probability)]
        reorder: f64,
        /// Delay added to every packet, in microseconds.
        #[arg(long, default_value_t = 0)]
        delay_us: u64,
        /// Seed of the fault injection's pseudo-random streams (one per link).
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Faults of one link direction, overriding the above: SRC:DST:key=value,...
        /// (keys loss, dup, reorder, delay_us), e.g. h1:h2:loss=0.05,delay_us=200.
        #[arg(long = "link-faults")]
        link_faults: Vec<faults::LinkSpec>,
        /// NIC model: line rate in Gb/s (0: unlimited).
        #[arg(long, default_value_t = nic::NicConfig::default().line_rate_gbps)]
        line_rate_gbps: f64,
        /// NIC model: port MTU in bytes (256, 512, 1024, 2048 or 4096); path MTUs are clamped to it.
        #[arg(long, default_value_t = nic::NicConfig::default().mtu)]
        mtu: u32,
        /// NIC model: QP contexts in the NIC's LRU cache (0: unlimited).
        #[arg(long, default_value_t = nic::NicConfig::default().qp_cache)]
        qp_cache: usize,
        /// NIC model: cost of a QP-context cache miss, in ns.
        #[arg(long, default_value_t = nic::NicConfig::default().qp_miss_ns)]
        qp_miss_ns: u64,
        /// NIC model: cost of fetching a work request, in ns.
        #[arg(long, default_value_t = nic::NicConfig::default().wqe_fetch_ns)]
        wqe_fetch_ns: u64,
        /// NIC model: most work requests of one ibv_post_send call fetched in one read (1: one
        /// at a time); the read costs wqe-fetch-ns per work request, before other QPs' packets.
        #[arg(long, default_value_t = nic::NicConfig::default().wqe_fetch_batch)]
        wqe_fetch_batch: u32,
        /// NIC model: the receive port's ingress buffer in KiB (arrivals are serialised at the
        /// line rate through it).
        #[arg(long, default_value_t = nic::NicConfig::default().rx_buffer_kib)]
        rx_buffer_kib: u64,
        /// NIC model: queue depth in KiB from which arriving packets are ECN-marked (0: never).
        #[arg(long, default_value_t = nic::NicConfig::default().ecn_threshold_kib)]
        ecn_threshold_kib: u64,
        /// NIC model: drop what does not fit into the receive buffer instead of pausing the
        /// sender (lossless, as InfiniBand or PFC-protected RoCE, is the default).
        #[arg(long)]
        rx_lossy: bool,
        /// DCQCN congestion control for RC QPs (CNPs answer ECN-marked packets, senders cut
        /// their QP's rate): on or off. It only acts when marking is on (--ecn-threshold-kib).
        #[arg(long, default_value = "on", value_parser = ["on", "off"])]
        dcqcn: String,
        /// NIC model: how many times slower than real time the NIC's time runs (a dilated
        /// NIC, as the testbed harness emulates); DCQCN's timers are stretched by it.
        #[arg(long, default_value_t = nic::NicConfig::default().time_scale)]
        time_scale: f64,
        /// AUSS in ACKs: receivers count their active unique senders, stamp N into ACKs and
        /// notify senders when it changes; senders publish each destination's N in
        /// <run>/hosts/NAME/auss. The value is how long a silent sender stays counted, in ms
        /// (0: off).
        #[arg(long, default_value_t = nic::NicConfig::default().auss_expiry_ms)]
        auss_expiry_ms: u64,
        /// AUSS: how long a receiver holds a sender's END (its send queue ran empty) before
        /// it stops counting it, in µs of the NIC's time (stretched by --time-scale); another
        /// message on the same QP within it cancels the END, so N does not flap when a
        /// sender's queue runs empty for a moment. 0: ENDs apply at once.
        #[arg(long, default_value_t = nic::NicConfig::default().auss_hold_us)]
        auss_hold_us: u64,
        /// Send every packet with its own sendto (no UDP GSO batching between engines).
        #[arg(long)]
        no_gso: bool,
    },
    /// Print the counters of host NAME's engine (packets, drops, duplicates, faults).
    Stats { name: String },
    /// Run a program as if on host NAME, with its softrnic device visible.
    Exec {
        #[arg(long)]
        host: String,
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
        cmd: Vec<String>,
    },
    /// Print host NAME's AUSS table: per destination its active unique senders N, epoch,
    /// incarnation and the age of the stamp in ms (read as a program would, through the
    /// device's softrnic_auss file).
    Auss { name: String },
    /// Print the IP address of host NAME.
    Addr { name: String },
    /// Take host NAME's link down or bring it up (port events, packets dropped while down).
    Link {
        name: String,
        #[arg(value_parser = ["up", "down"])]
        state: String,
    },
    /// How host NAME's NIC answers ECN-marked packets: `dcqcn` (a CNP for each, the default)
    /// or `dart` (Dart's receiver: none for congestion at its own port, which the senders'
    /// caps at R/N handle; see docs/softrnic-congestion.md). Applied within 100 ms; the
    /// engine's stats show it as `dart_receiver`.
    Receiver {
        name: String,
        #[arg(value_parser = ["dcqcn", "dart"])]
        policy: String,
    },
    /// Whether host NAME's NIC caps each RC QP at R/N, N the active senders its destination
    /// stamped into its newest ACK (Dart's rate limiter in the NIC; needs `up
    /// --auss-expiry-ms`): `on` or `off` (the default). Applied within 100 ms; the engine's
    /// stats show it as `dasr_caps`.
    Dasr {
        name: String,
        #[arg(value_parser = ["on", "off"])]
        state: String,
    },
    /// List the hosts of the current run.
    Status,
    /// Tear everything down (engines, namespaces, run directory).
    Down,
    /// Run the NIC engine of one host (started by `up`).
    #[command(hide = true)]
    Engine {
        #[arg(long)]
        host: String,
        #[arg(long)]
        ip: Ipv4Addr,
        #[arg(long)]
        socket: PathBuf,
        #[arg(long)]
        netns: Option<String>,
        /// Without root: the pid of the run's namespace holder, whose user namespace to join.
        #[arg(long)]
        holder: Option<i32>,
        #[arg(long)]
        faults: Option<PathBuf>,
        #[arg(long)]
        stats: Option<PathBuf>,
        #[arg(long)]
        nic: Option<PathBuf>,
        #[arg(long)]
        no_gso: bool,
        /// Every host's address (multicast datagrams are replicated to each).
        #[arg(long, value_delimiter = ',')]
        peers: Vec<Ipv4Addr>,
    },
    /// Hold the user and network namespaces of a run without root (started by `up`).
    #[command(hide = true)]
    Holder {
        #[arg(long)]
        hosts: usize,
        /// One network namespace per host (else loopback addresses).
        #[arg(long)]
        netns: bool,
    },
}

fn probability(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(p) if (0.0..=1.0).contains(&p) => Ok(p),
        _ => Err(format!("{s:?} is not a probability between 0 and 1")),
    }
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let run = hosts::run_dir(cli.run_dir);
    match cli.cmd {
        Cmd::Up {
            hosts: n,
            devices,
            loopback,
            loss,
            dup,
            reorder,
            delay_us,
            seed,
            link_faults,
            line_rate_gbps,
            mtu,
            qp_cache,
            qp_miss_ns,
            wqe_fetch_ns,
            wqe_fetch_batch,
            rx_buffer_kib,
            ecn_threshold_kib,
            rx_lossy,
            dcqcn,
            time_scale,
            auss_expiry_ms,
            auss_hold_us,
            no_gso,
        } => {
            let nic = nic::NicConfig {
                line_rate_gbps,
                mtu,
                qp_cache,
                qp_miss_ns,
                wqe_fetch_ns,
                wqe_fetch_batch,
                rx_buffer_kib,
                ecn_threshold_kib,
                rx_lossy,
                dcqcn: dcqcn == "on",
                time_scale,
                auss_expiry_ms,
                auss_hold_us,
            };
            let f = hosts::UpFaults {
                seed,
                default: faults::Faults {
                    loss,
                    dup,
                    reorder,
                    delay_us,
                },
                links: link_faults,
            };
            let st = hosts::up(&run, n, devices, loopback, &f, &nic, !no_gso)?;
            for h in &st.hosts {
                println!(
                    "{} {} {}",
                    h.name,
                    h.ip,
                    h.netns.as_deref().unwrap_or("(loopback)")
                );
            }
        }
        Cmd::Exec { host, cmd } => hosts::exec(&run, &host, &cmd)?,
        Cmd::Addr { name } => println!("{}", hosts::addr(&run, &name)?),
        Cmd::Link { name, state } => hosts::set_link(&run, &name, state == "up")?,
        Cmd::Dasr { name, state } => hosts::set_dasr_caps(&run, &name, state == "on")?,
        Cmd::Receiver { name, policy } => hosts::set_receiver_policy(
            &run,
            &name,
            softrnic::dart_receiver::Policy::parse(&policy)
                .ok_or_else(|| anyhow::anyhow!("no receiver policy {policy:?} (dcqcn, dart)"))?,
        )?,
        Cmd::Status => {
            let st = hosts::load_state(&run)?;
            for h in &st.hosts {
                println!(
                    "{} {} {} engine pid {}",
                    h.name,
                    h.ip,
                    h.netns.as_deref().unwrap_or("(loopback)"),
                    h.engine_pid
                );
            }
        }
        Cmd::Stats { name } => print!("{}", hosts::stats(&run, &name)?),
        Cmd::Auss { name } => print!("{}", hosts::auss(&run, &name)?),
        Cmd::Down => hosts::down(&run)?,
        Cmd::Holder { hosts: n, netns } => userns::holder_main(n, netns)?,
        Cmd::Engine {
            host,
            ip,
            socket,
            netns,
            holder,
            faults: faults_file,
            stats,
            nic: nic_file,
            no_gso,
            peers,
        } => {
            match (holder, netns) {
                (Some(pid), ns) => userns::join(&run, pid, ns.as_deref())?,
                (None, Some(ns)) => hosts::enter_host_netns(&ns)?,
                (None, None) => {}
            }
            let faults = match faults_file {
                Some(p) => {
                    let s = std::fs::read_to_string(&p)
                        .map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?;
                    faults::FaultConfig::decode(&s)
                        .map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?
                }
                None => faults::FaultConfig::default(),
            };
            let nic = match nic_file {
                Some(p) => {
                    let s = std::fs::read_to_string(&p)
                        .map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?;
                    nic::NicConfig::decode(&s)
                        .map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?
                }
                None => nic::NicConfig::default(),
            };
            engine::run(engine::EngineConfig {
                host_dir: socket.parent().map(Path::to_path_buf),
                nic,
                gso: !no_gso,
                host,
                ip,
                udp_port: softrnic::device::ENGINE_UDP_PORT,
                socket,
                faults,
                stats,
                peers,
            })?;
        }
    }
    Ok(())
}
