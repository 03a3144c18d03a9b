//! Which process owns which QP on a real NIC (issue 23; docs/tenants.md, "Real NICs"): the
//! kernel's RDMA resource tracking as iproute2 prints it, `rdma -j resource show qp` — a JSON
//! array of one object per QP, with the keys of the text form: `ifname` (device), `port`
//! (absent while the QP has none), `lqpn`, `rqpn` (connected QPs), `type` (RC, UC, UD,
//! GSI, …), `state`, and `pid` and `comm` for a user process's QP (a kernel QP has no `pid`;
//! its `comm` is the kernel module's). Keys this does not use (`ifindex`, `pdn`, `sq-psn`,
//! `rq-psn`, `path-mig-state`, what newer tools add) are ignored.
//!
//! The building block for real NICs' per-process usage: with it, `rdma statistic qp`
//! counters (by counter, or bound per pid) become bytes per process, as softrnic's stats
//! file gives them for emulated hosts. Not wired to the scanner yet: no machine here has an
//! RDMA device in its kernel to test that against.
//!
//! Pure: parses the text the caller got from the tool.

use serde::Deserialize;
use std::collections::BTreeMap;

/// One QP as the kernel tracks it.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct NicQp {
    #[serde(rename = "ifname")]
    pub dev: String,
    #[serde(default)]
    pub port: Option<u32>,
    pub lqpn: u32,
    #[serde(rename = "type", default)]
    pub qp_type: String,
    #[serde(default)]
    pub state: String,
    /// The owning process; None for the kernel's own QPs.
    #[serde(default)]
    pub pid: Option<u32>,
    #[serde(default)]
    pub comm: String,
}

/// The QPs in `rdma -j resource show qp`'s output; an error names what did not parse.
pub fn parse_qps(json: &str) -> Result<Vec<NicQp>, String> {
    let items: Vec<serde_json::Value> = serde_json::from_str(json)
        .map_err(|e| format!("rdma resource show qp: not a JSON array ({e})"))?;
    items
        .into_iter()
        .enumerate()
        .map(|(i, v)| {
            serde_json::from_value(v).map_err(|e| format!("rdma resource show qp: QP #{i}: {e}"))
        })
        .collect()
}

/// The user processes' QPs, by pid (the kernel's own left out).
pub fn by_pid(qps: &[NicQp]) -> BTreeMap<u32, Vec<&NicQp>> {
    let mut out: BTreeMap<u32, Vec<&NicQp>> = BTreeMap::new();
    for q in qps {
        if let Some(pid) = q.pid {
            out.entry(pid).or_default().push(q);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Written by hand in the format above (not captured from a device): the GSI QP the
    /// kernel keeps on every port, a connected RC QP of `ib_write_bw`, an RC QP of `drum-kv`
    /// not yet bound to a port, and a UD QP of the same `ib_write_bw` on a second device.
    const SAMPLE: &str = r#"[
      {"ifindex":2,"ifname":"mlx5_0","port":1,"lqpn":1,"type":"GSI","state":"RTS",
       "sq-psn":0,"comm":"ib_core"},
      {"ifindex":2,"ifname":"mlx5_0","port":1,"lqpn":1234,"rqpn":1300,"type":"RC",
       "state":"RTS","rq-psn":9012,"sq-psn":4567,"path-mig-state":"MIGRATED","pdn":5,
       "pid":4242,"comm":"ib_write_bw"},
      {"ifindex":2,"ifname":"mlx5_0","lqpn":1240,"type":"RC","state":"INIT","pdn":6,
       "pid":4243,"comm":"drum-kv"},
      {"ifindex":3,"ifname":"mlx5_1","port":1,"lqpn":77,"type":"UD","state":"RTS",
       "sq-psn":0,"pdn":7,"pid":4242,"comm":"ib_write_bw","ctxn":3}
    ]"#;

    #[test]
    fn qps_are_read_and_grouped_by_their_process() {
        let qps = parse_qps(SAMPLE).unwrap();
        assert_eq!(qps.len(), 4);
        assert_eq!(
            qps[1],
            NicQp {
                dev: "mlx5_0".into(),
                port: Some(1),
                lqpn: 1234,
                qp_type: "RC".into(),
                state: "RTS".into(),
                pid: Some(4242),
                comm: "ib_write_bw".into(),
            }
        );
        assert_eq!((qps[0].pid, qps[2].port), (None, None));
        let by = by_pid(&qps);
        assert_eq!(by.keys().copied().collect::<Vec<_>>(), [4242, 4243]);
        let w: Vec<(&str, u32)> = by[&4242].iter().map(|q| (&*q.dev, q.lqpn)).collect();
        assert_eq!(w, [("mlx5_0", 1234), ("mlx5_1", 77)]);
        assert!(parse_qps("[]").unwrap().is_empty());
    }

    #[test]
    fn what_is_not_the_tools_output_is_an_error_naming_it() {
        let e = parse_qps("link mlx5_0/1 lqpn 1 type GSI").unwrap_err();
        assert!(e.contains("not a JSON array"), "{e}");
        let e = parse_qps(r#"[{"ifname":"mlx5_0","lqpn":1},{"ifname":"mlx5_0"}]"#).unwrap_err();
        assert!(e.contains("QP #1") && e.contains("lqpn"), "{e}");
        let e = parse_qps(r#"[{"ifname":"x","lqpn":-1}]"#).unwrap_err();
        assert!(e.contains("QP #0"), "{e}");
    }
}
