//! The shim hub's Prometheus metrics, read at each scrape: registered processes, what each
//! app's shims report, each process's part of its app's grant, the kernel identities behind
//! each app and the NIC users no shim governs, and the registered ones that drive hardware
//! queues directly.

use crate::grant_audit::OverGrant;
use crate::shim_hub::{ShimHub, ShimUsage};
use std::collections::BTreeMap;
use std::sync::Arc;

/// The hub's metrics at each scrape: registered processes, and per app (label `app`) what
/// its shims report.
pub struct ShimMetrics(pub Arc<ShimHub>);

impl std::fmt::Debug for ShimMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ShimMetrics")
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct AppLabel {
    app: String,
}

impl prometheus_client::collector::Collector for ShimMetrics {
    fn encode(
        &self,
        mut enc: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;
        use prometheus_client::metrics::MetricType;
        let usage = self.0.usage();
        let mut per_app: BTreeMap<&str, [u64; 4]> = BTreeMap::new();
        for u in &usage {
            let e = per_app.entry(&u.app).or_default();
            e[0] += u.send_bytes;
            e[1] += u.send_wqes;
            e[2] += u.deferred_wqes;
            e[3] += u.queued_wqes;
        }
        for (name, help, v) in [
            (
                "drum_agent_shims",
                "Processes registered by their shim.",
                usage.len(),
            ),
            (
                "drum_agent_dasr_caps",
                "Receivers this host's shims are capped towards.",
                self.0.caps().len(),
            ),
        ] {
            let g = ConstGauge::new(v as i64);
            g.encode(enc.encode_descriptor(name, help, None, g.metric_type())?)?;
        }
        // Counter names without `_total`: the encoder appends it.
        let series = [
            (
                "drum_agent_app_send_bytes",
                MetricType::Counter,
                "Bytes the app's shims posted.",
            ),
            (
                "drum_agent_app_send_wqes",
                MetricType::Counter,
                "Send WQEs the app's shims posted.",
            ),
            (
                "drum_agent_app_deferred_wqes",
                MetricType::Counter,
                "WQEs the app's shims held back before posting.",
            ),
            (
                "drum_agent_app_queued_wqes",
                MetricType::Gauge,
                "WQEs held back now.",
            ),
        ];
        for (i, (name, kind, help)) in series.into_iter().enumerate() {
            let mut family = enc.encode_descriptor(name, help, None, kind)?;
            for (app, v) in &per_app {
                let label = AppLabel {
                    app: app.to_string(),
                };
                let m = family.encode_family(&label)?;
                match kind {
                    MetricType::Counter => ConstCounter::new(v[i]).encode(m)?,
                    _ => ConstGauge::new(v[i] as i64).encode(m)?,
                }
            }
        }
        let mut identities: BTreeMap<(&str, u32, u32, &str), u64> = BTreeMap::new();
        for u in &usage {
            *identities
                .entry((&u.app, u.uid, u.gid, &u.cgroup))
                .or_default() += 1;
        }
        let mut family = enc.encode_descriptor(
            "drum_agent_app_identity_processes",
            "Registered processes per app and kernel identity.",
            None,
            MetricType::Gauge,
        )?;
        for ((app, uid, gid, cgroup), n) in identities {
            let label = IdentityLabels {
                app: app.to_string(),
                uid,
                gid,
                cgroup: cgroup.to_string(),
            };
            ConstGauge::new(n as i64).encode(family.encode_family(&label)?)?;
        }
        // Each process's part of its app's grant (docs/tenants.md): the sum over an app's
        // processes is its grant.
        for (name, help, value) in [
            (
                "drum_agent_process_grant_part",
                "The process's part of its app's grant (1 for an app's only process).",
                (|u: &ShimUsage| u.grant_part) as fn(&ShimUsage) -> f64,
            ),
            (
                "drum_agent_process_grant_bytes_per_second",
                "The payload bytes per second the process's table grants it (0: unlimited).",
                |u| u.grant_bytes_per_s as f64,
            ),
        ] {
            let mut family = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for u in &usage {
                let label = ProcessLabels {
                    pid: u.pid,
                    uid: u.uid,
                    app: u.app.clone(),
                };
                ConstGauge::new(value(u)).encode(family.encode_family(&label)?)?;
            }
        }
        let ungoverned = self.0.ungoverned();
        let g = ConstGauge::new(ungoverned.len() as i64);
        g.encode(enc.encode_descriptor(
            "drum_agent_ungoverned_processes",
            "Processes holding an RDMA device without a registered shim.",
            None,
            g.metric_type(),
        )?)?;
        let g = ConstGauge::new(self.0.ungoverned_share());
        g.encode(enc.encode_descriptor(
            "drum_agent_ungoverned_share",
            "What they send, as a fraction of the line rate (taken from the host's budget).",
            None,
            g.metric_type(),
        )?)?;
        let mut family = enc.encode_descriptor(
            "drum_agent_ungoverned_tx_bytes_per_second",
            "What one ungoverned process sends.",
            None,
            MetricType::Gauge,
        )?;
        for u in &ungoverned {
            let label = UngovernedLabels {
                pid: u.pid,
                uid: u.uid,
                exe: u.exe.clone(),
                cgroup: u.cgroup.clone(),
            };
            ConstGauge::new(u.tx_bytes_per_s).encode(family.encode_family(&label)?)?;
        }
        let over = self.0.over_grant();
        let parts: usize = over.iter().map(|o| o.processes.len()).sum();
        for (name, help, n) in [
            (
                "drum_agent_over_grant_apps",
                "Apps whose processes on this host together send above the app's grant (beyond the audit's tolerance).",
                over.len(),
            ),
            (
                "drum_agent_over_grant_processes",
                "The processes of those apps.",
                parts,
            ),
        ] {
            let g = ConstGauge::new(n as i64);
            g.encode(enc.encode_descriptor(name, help, None, g.metric_type())?)?;
        }
        for (name, help, value) in [
            (
                "drum_agent_over_grant_app_tx_bytes_per_second",
                "What such an app's processes sent together over the audit's window (at the NIC).",
                (|o: &OverGrant| o.measured_bytes_per_s) as fn(&OverGrant) -> f64,
            ),
            (
                "drum_agent_over_grant_granted_bytes_per_second",
                "What its grant allowed over the same window.",
                |o: &OverGrant| o.grant_bytes_per_s,
            ),
        ] {
            let mut family = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for o in &over {
                let label = AppLabel { app: o.app.clone() };
                ConstGauge::new(value(o)).encode(family.encode_family(&label)?)?;
            }
        }
        let mut family = enc.encode_descriptor(
            "drum_agent_over_grant_tx_bytes_per_second",
            "What one process of such an app sent over the window (at the NIC).",
            None,
            MetricType::Gauge,
        )?;
        for o in &over {
            for p in &o.processes {
                let label = ProcessLabels {
                    pid: p.pid,
                    uid: p.uid,
                    app: o.app.clone(),
                };
                ConstGauge::new(p.measured_bytes_per_s).encode(family.encode_family(&label)?)?;
            }
        }
        let direct = self.0.direct_verbs();
        let g = ConstGauge::new(direct.len() as i64);
        g.encode(enc.encode_descriptor(
            "drum_agent_direct_verbs_processes",
            "Registered processes that took hardware queues with direct verbs (governed in part).",
            None,
            g.metric_type(),
        )?)?;
        let mut family = enc.encode_descriptor(
            "drum_agent_direct_verbs_queues",
            "Hardware queues one such process took (mlx5dv_init_obj).",
            None,
            MetricType::Gauge,
        )?;
        for d in &direct {
            let label = ProcessLabels {
                pid: d.pid,
                uid: d.uid,
                app: d.app.clone(),
            };
            ConstGauge::new(i64::try_from(d.queues).unwrap_or(i64::MAX))
                .encode(family.encode_family(&label)?)?;
        }
        Ok(())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct ProcessLabels {
    pid: u32,
    uid: u32,
    app: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct IdentityLabels {
    app: String,
    uid: u32,
    gid: u32,
    cgroup: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct UngovernedLabels {
    pid: u32,
    uid: u32,
    exe: String,
    cgroup: String,
}
