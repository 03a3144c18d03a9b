//! Joins the shim hub and DASR on one host: when this host's shims start long-message
//! traffic towards a receiver (the hub aggregates QPs per receiver GID), the agent announces
//! it to the receiver's agent; the caps the receivers answer with go into every local
//! shim's table. A receiver's agent is found from the peer GID the shim learnt at RTR: an
//! IPv4-mapped GID (RoCE v2, softrnic) names the receiver's address, and its agent listens
//! on the same DASR port as ours.

use crate::dasr::{CapMap, DasrConfig, DasrHandle, DasrService};
use crate::shim_hub::{Flow, ShimHub, ShimSettings, TrafficHook};
use drum_table::message::{gid_of_ipv4, ipv4_of_gid};
use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use tokio::sync::watch;

/// Starts the shim hub and, with `dasr`, the DASR service announcing the hub's traffic and
/// feeding the receivers' caps back into the shims' tables.
pub async fn start(
    shim: &ShimSettings,
    dasr: Option<DasrConfig>,
) -> anyhow::Result<(Arc<ShimHub>, Option<DasrService>)> {
    let dasr = match dasr {
        Some(cfg) => Some(
            DasrService::bind(cfg)
                .await
                .map_err(|e| anyhow::anyhow!("[dasr]: {e}"))?,
        ),
        None => None,
    };
    let hook = dasr
        .as_ref()
        .map(|d| announcer(d.handle(), d.local_addr().port()));
    let hub = Arc::new(ShimHub::start(shim.clone(), hook)?);
    if let Some(d) = &dasr {
        tokio::spawn(apply_caps(d.caps(), hub.clone()));
    }
    Ok((hub, dasr))
}

/// The hub's traffic hook: announce to the receiver's agent at `port`, one message per
/// receiver and app (the hub reports its first busy QP and its last), in the app's incast
/// group when it has one.
pub fn announcer(dasr: DasrHandle, port: u16) -> TrafficHook {
    Box::new(move |f: &Flow, busy| {
        let Some(ip) = ipv4_of_gid(&f.peer) else {
            tracing::debug!("peer GID is not IPv4-mapped; no DASR announcement");
            return;
        };
        let dest = SocketAddr::new(IpAddr::V4(ip), port);
        match (busy, f.lookahead) {
            (true, Some(group)) => dasr.message_started_in_group(dest, f.msg_id, group),
            (true, None) => dasr.message_started(dest, f.msg_id),
            (false, _) => dasr.message_ended(dest, f.msg_id),
        }
    })
}

/// Copies every change of the receivers' caps into the shims' tables, until the DASR
/// service stops.
pub async fn apply_caps(mut caps: watch::Receiver<CapMap>, hub: Arc<ShimHub>) {
    let mut applied: BTreeSet<[u8; 16]> = BTreeSet::new();
    loop {
        let now: Vec<([u8; 16], u64, u64)> = caps
            .borrow_and_update()
            .iter()
            .filter_map(|(addr, v)| {
                let IpAddr::V4(ip) = addr.ip() else {
                    return None;
                };
                let cap = v.cap.filter(|c| c.is_finite() && *c >= 1.0)?;
                Some((gid_of_ipv4(ip), cap.round() as u64, u64::from(v.n)))
            })
            .collect();
        let live: BTreeSet<[u8; 16]> = now.iter().map(|c| c.0).collect();
        for gone in applied.difference(&live) {
            hub.set_peer_cap(*gone, 0, 0);
        }
        for (gid, cap, n) in &now {
            hub.set_peer_cap(*gid, *cap, *n);
        }
        applied = live;
        if caps.changed().await.is_err() {
            for g in &applied {
                hub.set_peer_cap(*g, 0, 0);
            }
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    #[test]
    fn gids_and_addresses_map_both_ways() {
        let ip = Ipv4Addr::new(10, 77, 0, 2);
        let g = gid_of_ipv4(ip);
        assert_eq!(ipv4_of_gid(&g), Some(ip));
        let mut ib = g;
        ib[0] = 0xfe;
        assert_eq!(
            ipv4_of_gid(&ib),
            None,
            "a link-local IB GID names no IPv4 host"
        );
    }
}
