//! Wire messages and framing.
//!
//! A frame is an 8-byte header — magic `b"DR"`, protocol version (u16, big endian), payload
//! length (u32, big endian) — followed by the payload, one message in bincode 2's standard
//! encoding. The header is checked as soon as its 8 bytes are in, so an unknown version or an
//! oversized length is refused before any payload is buffered. Any error poisons the stream
//! (framing is lost), so the peer's connection is closed; other connections are unaffected.

use crate::admm::FacilityTerm;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// The version this build speaks. A peer announcing another one is refused, never guessed at.
/// Version 2 added top-k selection: the join's `rank`, `interest`, `floor` and `exchanges`, and
/// the `Select`/`Proposal`/`Verdict`/`Selected`/`Restart` messages (docs/control-plane.md).
/// Version 3 added `Reselect`, the agent's request for a re-selection when its apps change.
/// Version 4 lets a pair use several facilities (a `Proposal` lists every facility of the
/// parked and the activated pair) and adds the live problem's `Host`, `Update`, `Policy` and
/// `Facilities`.
/// Version 5 gives every facility its own penalty: a `Round` carries `(d_f, ρ_f)` per facility
/// and a `Join` the terms the agent last stepped with.
/// Version 6 adds those terms to the live `Update`.
/// Version 7 carries each app's kernel identities in the live `Host` report
/// (`AppReport::identities`, bounded by [`crate::app_identity`]).
/// Version 8 lets selection and the live problem pass a relay: `RackProposals`,
/// `RackVerdicts` and `RackHost`.
pub const PROTOCOL_VERSION: u16 = 8;
pub const MAGIC: [u8; 2] = *b"DR";
pub const HEADER_LEN: usize = 8;
/// Hard limit on a payload: a host reports at most k facilities, so real messages are a few
/// hundred bytes; 1 MiB leaves room for large k while bounding what a peer can make us buffer.
pub const MAX_FRAME: usize = 1 << 20;

#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum WireError {
    #[error("bad magic {0:02x?}: not a DRUM control-plane frame")]
    BadMagic([u8; 2]),
    #[error("unsupported protocol version {got} (this build speaks {PROTOCOL_VERSION})")]
    UnsupportedVersion { got: u16 },
    #[error("frame of {len} bytes exceeds the limit of {MAX_FRAME} bytes")]
    Oversized { len: usize },
    #[error("malformed payload: {0}")]
    Malformed(String),
    #[error("payload has {0} trailing bytes after the message")]
    TrailingBytes(usize),
    #[error("message does not encode: {0}")]
    Encode(String),
}

/// Agent → coordinator.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum AgentMsg {
    Join(Join),
    Contribution(ContributionMsg),
    Heartbeat {
        seq: u64,
    },
    /// Orderly departure: the coordinator removes the host's contribution at once.
    Leave,
    /// The host's answer to `Select`: the swap it proposes (park and/or activate), as the
    /// facilities concerned and the floor usage `b·x_min` of each pair.
    Proposal(ProposalMsg),
    /// The host's active sets after a selection exchange (`Verdict` or `Restart`) were applied.
    Selected(SelectedMsg),
    /// The set of apps running on the host changed (one arrived or left): please run a
    /// selection exchange at the first round boundary with at least this iteration.
    Reselect {
        iteration: u64,
    },
    /// Something the host's selection depends on changed materially (a weight, a demand cap,
    /// `a`): the next periodic exchange may re-select. Sent once per exchange.
    Changed,
    /// Live problem: the host's NIC and its row with the current grants (docs/live-problem.md).
    /// Sent after the facility table arrives and whenever the row changes.
    Host(crate::live::HostReport),
    /// Live problem: the host's problem changed (an app arrived or left, the facility table
    /// grew, a connection moved): its active set and usage now, as in `Join`.
    Update(UpdateMsg),
    /// A relay's answer to `Select`: its agents' proposals, each with the agent's rank, so
    /// the coordinator decides each as it would a host of its own (`RackVerdicts`).
    RackProposals(RackProposalsMsg),
    /// Live problem through a relay: the `Host` report of one of its agents, named, or `None`
    /// when that agent left the relay (its report goes).
    RackHost(RackHostMsg),
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RackHostMsg {
    pub host: String,
    pub report: Option<crate::live::HostReport>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RackProposalsMsg {
    pub exchange: u32,
    pub hosts: Vec<HostProposal>,
}

/// One agent's `Proposal` behind a relay, with its rank (its `Join`'s).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HostProposal {
    pub rank: u32,
    /// As in [`ProposalMsg`].
    pub park: Option<Vec<(u32, f64)>>,
    pub activate: Option<Vec<(u32, f64)>>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct UpdateMsg {
    /// As in [`Join`].
    pub pairs: Vec<(u32, u32)>,
    pub entries: Vec<(u32, f64)>,
    pub interest: Vec<u32>,
    pub floor: Vec<(u32, f64)>,
    /// As in [`Join`], in this coordinator's facility numbers: the terms the host stepped
    /// with under its previous coordinator, matched by facility id, so a restarted
    /// coordinator resumes the prices (a live `Join` precedes the facility table and cannot
    /// carry them).
    pub last_d: Vec<FacilityTerm>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProposalMsg {
    pub exchange: u32,
    /// `(facility, b_f·x_min)` for every facility of the member the host parks (sorted by
    /// facility; empty for a pair that uses none).
    pub park: Option<Vec<(u32, f64)>>,
    /// The same for the outsider the host would activate.
    pub activate: Option<Vec<(u32, f64)>>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SelectedMsg {
    pub exchange: u32,
    /// As in [`Join`].
    pub pairs: Vec<(u32, u32)>,
    pub floor: Vec<(u32, f64)>,
    pub entries: Vec<(u32, f64)>,
}

/// Shard `index` of `count`: a coordinator process owning the facilities whose id hashes to
/// `index` (`super::shard_of`). Shards share nothing; `0/1` owns every facility.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shard {
    pub index: u32,
    pub count: u32,
}

impl Shard {
    /// The only shard of an unsharded coordinator.
    pub const WHOLE: Shard = Shard { index: 0, count: 1 };

    pub fn owns(&self, facility_id: &str) -> bool {
        super::shard_of(facility_id, self.count) == self.index
    }
}

impl Default for Shard {
    fn default() -> Self {
        Shard::WHOLE
    }
}

impl std::fmt::Display for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

impl std::str::FromStr for Shard {
    type Err = String;

    /// `I/N` with `0 ≤ I < N`.
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("shard must be I/N with 0 <= I < N, got {s:?}");
        let (i, n) = s.split_once('/').ok_or_else(bad)?;
        let index: u32 = i.trim().parse().map_err(|_| bad())?;
        let count: u32 = n.trim().parse().map_err(|_| bad())?;
        if count == 0 || index >= count {
            return Err(bad());
        }
        Ok(Shard { index, count })
    }
}

/// The selection options the coordinator hands the agents with every `Select`, so that every
/// host of a cluster decides by the same rules (`drum_common::selection::SelectionOptions`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SelectionParams {
    pub swap_prob: f64,
    pub hysteresis: f64,
    pub fairness: f64,
    pub discount: f64,
    pub seed: u64,
}

impl From<crate::selection::SelectionOptions> for SelectionParams {
    fn from(o: crate::selection::SelectionOptions) -> Self {
        Self {
            swap_prob: o.swap_prob,
            hysteresis: o.hysteresis,
            fairness: o.fairness,
            discount: o.discount,
            seed: o.seed,
        }
    }
}

impl From<SelectionParams> for crate::selection::SelectionOptions {
    fn from(o: SelectionParams) -> Self {
        Self {
            swap_prob: o.swap_prob,
            hysteresis: o.hysteresis,
            fairness: o.fairness,
            discount: o.discount,
            seed: o.seed,
            // How an agent computes its decision, not part of the decision: always pruned.
            prune: true,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Join {
    pub host: String,
    /// [`super::facility_digest`] of the agent's facility list.
    pub facility_digest: u64,
    /// `(facility, active pairs of this host using it)`, facility ascending.
    pub pairs: Vec<(u32, u32)>,
    /// The host's current `Σ b·x` per facility: a fresh agent's best response to zero prices,
    /// a rejoining one's last rates, so a restarted coordinator resumes warm.
    pub entries: Vec<(u32, f64)>,
    /// The last iteration the agent took part in (0 if none), so numbering survives a
    /// coordinator restart.
    pub last_iteration: u64,
    /// The facility terms of that iteration (empty if none): a restarted coordinator rebuilds
    /// its penalties and duals from them (`u_f ≈ n_f·d_f` near convergence) instead of
    /// restarting prices from zero.
    pub last_d: Vec<FacilityTerm>,
    /// The host's position in the instance: selection verdicts are decided in this order.
    pub rank: u32,
    /// Every facility one of the host's apps uses, active or parked, ascending: `Select`
    /// carries their prices.
    pub interest: Vec<u32>,
    /// `(facility, Σ b·x_min)` over the host's active pairs, ascending: the floor usage the
    /// coordinator checks activations against.
    pub floor: Vec<(u32, f64)>,
    /// Selection exchanges the host has completed, so a restarted coordinator resumes the
    /// schedule instead of selecting from scratch.
    pub exchanges: u32,
}

impl Join {
    /// The checks that need nothing but the message and the number of facilities, shared by
    /// the coordinator and the relay (each adds its own: digest, drained hosts, shards). The
    /// host id follows [`super::valid_name`], the rule `drain-host` takes, so every member
    /// can be drained.
    pub fn check_shape(&self, facilities: u32) -> Result<(), String> {
        let nf = facilities;
        if !super::valid_name(&self.host) {
            return Err("host id must be 1 to 64 letters, digits, '.', '_' or '-'".into());
        }
        check_usage("contribution entries", &self.entries, nf)?;
        check_usage("floor", &self.floor, nf)?;
        if !ascending(&self.pairs, nf) {
            return Err("pair counts must name known facilities in ascending order".into());
        }
        check_interest(&self.interest, nf)?;
        check_last_d(&self.last_d, nf)
    }
}

impl UpdateMsg {
    /// The checks that need nothing but the message and the number of facilities, shared by
    /// the coordinator and the relay (the coordinator adds its shard's ownership).
    pub fn check_shape(&self, facilities: u32) -> Result<(), String> {
        let nf = facilities;
        if !ascending(&self.pairs, nf) {
            return Err("pair counts must name known facilities in ascending order".into());
        }
        check_usage("contribution entries", &self.entries, nf)?;
        check_usage("floor", &self.floor, nf)?;
        check_interest(&self.interest, nf)?;
        check_last_d(&self.last_d, nf)
    }
}

impl SelectedMsg {
    /// As [`UpdateMsg::check_shape`].
    pub fn check_shape(&self, facilities: u32) -> Result<(), String> {
        if !ascending(&self.pairs, facilities) {
            return Err("pair counts must name known facilities in ascending order".into());
        }
        check_usage("contribution entries", &self.entries, facilities)?;
        check_usage("floor", &self.floor, facilities)
    }
}

/// A proposal's park or activation, if any: known facilities in ascending order with finite,
/// non-negative floor usage.
pub fn floor_use_ok(list: &Option<Vec<(u32, f64)>>, facilities: u32) -> bool {
    list.as_ref().is_none_or(|l| {
        ascending(l, facilities) && l.iter().all(|&(_, v)| v.is_finite() && v >= 0.0)
    })
}

/// Facility indices: known, strictly ascending.
fn check_interest(interest: &[u32], facilities: u32) -> Result<(), String> {
    if interest.windows(2).all(|w| w[0] < w[1]) && interest.iter().all(|&f| f < facilities) {
        Ok(())
    } else {
        Err("interest must name known facilities in ascending order".into())
    }
}

/// Facility-keyed entries: known facilities, strictly ascending.
pub fn ascending<T>(v: &[(u32, T)], facilities: u32) -> bool {
    v.windows(2).all(|w| w[0].0 < w[1].0) && v.iter().all(|e| e.0 < facilities)
}

/// Per-facility usage (`Σ b·x`): ascending known facilities with finite, non-negative values.
pub fn check_usage(what: &str, v: &[(u32, f64)], facilities: u32) -> Result<(), String> {
    if !ascending(v, facilities) || v.iter().any(|e| !(e.1.is_finite() && e.1 >= 0.0)) {
        return Err(format!(
            "{what} must name known facilities in ascending order with finite, non-negative values"
        ));
    }
    Ok(())
}

/// The facility terms an agent reports back: known facilities, finite `d`, positive `ρ`.
pub fn check_last_d(last_d: &[FacilityTerm], facilities: u32) -> Result<(), String> {
    if last_d.iter().any(|e| {
        e.facility >= facilities || !e.d.is_finite() || !(e.rho.is_finite() && e.rho > 0.0)
    }) {
        return Err(
            "last_d must name known facilities with finite values and positive penalties".into(),
        );
    }
    Ok(())
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ContributionMsg {
    pub epoch: u64,
    pub iteration: u64,
    /// `Σ b·x` per facility after the host's x-step for this round, facility ascending.
    pub entries: Vec<(u32, f64)>,
}

/// Coordinator → agent.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum CoordMsg {
    Welcome {
        epoch: u64,
        iteration: u64,
        heartbeat_ms: u64,
        /// Which shard of the facilities this coordinator owns (`0/1`: all of them).
        shard: Shard,
    },
    Refused {
        reason: String,
    },
    /// Run the x-step for `iteration` with these `d_f` and `ρ_f` (only the host's facilities,
    /// ascending).
    Round {
        epoch: u64,
        iteration: u64,
        d: Vec<FacilityTerm>,
    },
    HeartbeatAck {
        seq: u64,
    },
    /// Selection round `round` (exchange `exchange`): evaluate the host at these prices (every
    /// facility of the host's `interest`) and answer with a `Proposal`.
    Select {
        exchange: u32,
        round: u32,
        prices: Vec<(u32, f64)>,
        options: SelectionParams,
    },
    /// Whether the proposed activation fits its facility's floor; a proposed park always holds.
    /// The host applies its swap and answers with `Selected`.
    Verdict {
        exchange: u32,
        activate: bool,
    },
    /// To a relay: the verdict of each of its `RackProposals`, in their order. It answers
    /// with one `Selected`, its rack's sums.
    RackVerdicts {
        exchange: u32,
        activate: Vec<bool>,
    },
    /// The priced restart (docs/model.md): choose the initial active sets again, greedily at
    /// half these prices (every facility), restart from the best response to zero prices and
    /// answer with `Selected`.
    Restart {
        exchange: u32,
        prices: Vec<(u32, f64)>,
    },
    /// Operator change (`set-weight`): every pair of app `app` (its id in the instance) now has
    /// weight `weight`, on every host, from the host's next step on.
    SetWeight {
        app: String,
        weight: f64,
    },
    /// Live problem: the shape and the weights in force (after `Welcome` and on every change).
    Policy(crate::live::LivePolicy),
    /// Live problem: the facility table, indexed as every facility list on the wire (after
    /// `Welcome` and whenever a host joins with a new link or its link changes).
    Facilities(Vec<crate::live::LiveFacility>),
}

fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<MAX_FRAME>()
}

/// One complete frame (header and payload) for `msg`.
pub fn encode<M: Serialize>(msg: &M) -> Result<Vec<u8>, WireError> {
    let payload = bincode::serde::encode_to_vec(msg, config())
        .map_err(|e| WireError::Encode(e.to_string()))?;
    if payload.len() > MAX_FRAME {
        return Err(WireError::Oversized { len: payload.len() });
    }
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(&payload);
    Ok(out)
}

/// Checks a header; returns the payload length.
pub fn parse_header(h: &[u8; HEADER_LEN]) -> Result<usize, WireError> {
    let magic = [h[0], h[1]];
    if magic != MAGIC {
        return Err(WireError::BadMagic(magic));
    }
    let version = u16::from_be_bytes([h[2], h[3]]);
    if version != PROTOCOL_VERSION {
        return Err(WireError::UnsupportedVersion { got: version });
    }
    let len = u32::from_be_bytes([h[4], h[5], h[6], h[7]]) as usize;
    if len > MAX_FRAME {
        return Err(WireError::Oversized { len });
    }
    Ok(len)
}

/// Decodes one payload, which must hold exactly one message.
pub fn decode_payload<M: DeserializeOwned>(payload: &[u8]) -> Result<M, WireError> {
    let (msg, used) = bincode::serde::decode_from_slice(payload, config())
        .map_err(|e| WireError::Malformed(e.to_string()))?;
    if used != payload.len() {
        return Err(WireError::TrailingBytes(payload.len() - used));
    }
    Ok(msg)
}

/// Reassembles frames from a byte stream that arrives in arbitrary pieces.
#[derive(Debug, Default)]
pub struct FrameDecoder {
    buf: Vec<u8>,
    /// Set after the first error: the stream has lost its framing for good.
    failed: Option<WireError>,
}

impl FrameDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn push(&mut self, bytes: &[u8]) {
        if self.failed.is_none() {
            self.buf.extend_from_slice(bytes);
        }
    }

    /// Bytes received but not yet consumed.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// The next complete message, `Ok(None)` if more bytes are needed.
    pub fn next_msg<M: DeserializeOwned>(&mut self) -> Result<Option<M>, WireError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let r = self.try_next();
        if let Err(e) = &r {
            self.failed = Some(e.clone());
            self.buf = Vec::new();
        }
        r
    }

    fn try_next<M: DeserializeOwned>(&mut self) -> Result<Option<M>, WireError> {
        if self.buf.len() < HEADER_LEN {
            // Refuse a bad magic or version from the first bytes on, not only once 8 arrived.
            if self.buf.len() >= 2 && self.buf[..2] != MAGIC {
                return Err(WireError::BadMagic([self.buf[0], self.buf[1]]));
            }
            return Ok(None);
        }
        let header: [u8; HEADER_LEN] = self.buf[..HEADER_LEN].try_into().expect("length checked");
        let len = parse_header(&header)?;
        if self.buf.len() < HEADER_LEN + len {
            return Ok(None);
        }
        let msg = decode_payload(&self.buf[HEADER_LEN..HEADER_LEN + len])?;
        self.buf.drain(..HEADER_LEN + len);
        Ok(Some(msg))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn join() -> AgentMsg {
        AgentMsg::Join(Join {
            host: "h1".into(),
            facility_digest: 42,
            pairs: vec![(0, 2), (3, 1)],
            entries: vec![(0, 0.5), (3, 0.25)],
            last_iteration: 7,
            last_d: vec![FacilityTerm {
                facility: 0,
                d: 0.01,
                rho: 2.0,
            }],
            rank: 1,
            interest: vec![0, 2, 3],
            floor: vec![(0, 0.002), (3, 0.001)],
            exchanges: 3,
        })
    }

    /// One rule for the coordinator and the relay: what one refuses the other refuses.
    #[test]
    fn a_joins_shape_is_checked_field_by_field() {
        let AgentMsg::Join(good) = join() else {
            unreachable!()
        };
        assert_eq!(good.check_shape(4), Ok(()));
        let refused = |change: &dyn Fn(&mut Join), says: &str| {
            let mut j = good.clone();
            change(&mut j);
            let e = j.check_shape(4).unwrap_err();
            assert!(e.contains(says), "{e}");
        };
        refused(&|j| j.host = String::new(), "host id");
        refused(&|j| j.host = "h".repeat(65), "host id");
        refused(&|j| j.host = "h 1".into(), "host id");
        refused(
            &|j| j.entries = vec![(3, 0.5), (0, 0.5)],
            "contribution entries",
        );
        refused(&|j| j.entries = vec![(0, f64::NAN)], "contribution entries");
        refused(&|j| j.floor = vec![(4, 0.0)], "floor");
        refused(&|j| j.pairs = vec![(3, 1), (3, 1)], "pair counts");
        refused(&|j| j.interest = vec![0, 4], "interest");
        refused(&|j| j.last_d[0].rho = 0.0, "last_d");
        assert!(good.check_shape(3).is_err(), "facility 3 of 3");
    }

    #[test]
    fn frames_survive_arbitrary_splits() {
        let msgs = vec![
            join(),
            AgentMsg::Heartbeat { seq: 9 },
            AgentMsg::Leave,
            AgentMsg::Reselect { iteration: 4 },
            AgentMsg::Contribution(ContributionMsg {
                epoch: 1,
                iteration: 2,
                entries: vec![(1, 1.5)],
            }),
        ];
        let bytes: Vec<u8> = msgs.iter().flat_map(|m| encode(m).unwrap()).collect();
        for chunk in [1, 3, 7, 64] {
            let mut dec = FrameDecoder::new();
            let mut got = Vec::new();
            for piece in bytes.chunks(chunk) {
                dec.push(piece);
                while let Some(m) = dec.next_msg::<AgentMsg>().unwrap() {
                    got.push(m);
                }
            }
            assert_eq!(got, msgs);
            assert_eq!(dec.buffered(), 0);
        }
    }

    #[test]
    fn unknown_version_is_refused_by_number() {
        let mut f = encode(&AgentMsg::Leave).unwrap();
        f[2..4].copy_from_slice(&99u16.to_be_bytes());
        let mut dec = FrameDecoder::new();
        dec.push(&f);
        assert_eq!(
            dec.next_msg::<AgentMsg>(),
            Err(WireError::UnsupportedVersion { got: 99 })
        );
        // The stream stays refused: framing is lost.
        dec.push(&encode(&AgentMsg::Leave).unwrap());
        assert!(dec.next_msg::<AgentMsg>().is_err());
    }

    #[test]
    fn oversized_length_is_refused_before_the_payload_arrives() {
        let mut h = Vec::from(MAGIC);
        h.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
        h.extend_from_slice(&((MAX_FRAME + 1) as u32).to_be_bytes());
        let mut dec = FrameDecoder::new();
        dec.push(&h);
        assert_eq!(
            dec.next_msg::<AgentMsg>(),
            Err(WireError::Oversized { len: MAX_FRAME + 1 })
        );
    }

    #[test]
    fn garbage_and_truncation() {
        let mut dec = FrameDecoder::new();
        dec.push(b"GET / HTTP/1.1\r\n");
        assert!(matches!(
            dec.next_msg::<AgentMsg>(),
            Err(WireError::BadMagic(_))
        ));
        // A truncated frame is simply incomplete: nothing is decoded from it.
        let f = encode(&join()).unwrap();
        let mut dec = FrameDecoder::new();
        dec.push(&f[..f.len() - 1]);
        assert_eq!(dec.next_msg::<AgentMsg>(), Ok(None));
        // A header that claims fewer bytes than the message needs is malformed.
        let mut short = f.clone();
        let len = (f.len() - HEADER_LEN - 1) as u32;
        short[4..8].copy_from_slice(&len.to_be_bytes());
        short.pop();
        let mut dec = FrameDecoder::new();
        dec.push(&short);
        assert!(matches!(
            dec.next_msg::<AgentMsg>(),
            Err(WireError::Malformed(_))
        ));
        // Extra bytes inside a payload are refused, not ignored.
        let mut long = encode(&AgentMsg::Leave).unwrap();
        long[4..8].copy_from_slice(&2u32.to_be_bytes());
        long.push(0);
        let mut dec = FrameDecoder::new();
        dec.push(&long);
        assert_eq!(dec.next_msg::<AgentMsg>(), Err(WireError::TrailingBytes(1)));
    }

    fn entries() -> impl Strategy<Value = Vec<(u32, f64)>> {
        prop::collection::vec((any::<u32>(), -1e9f64..1e9), 0..20)
    }

    fn terms() -> impl Strategy<Value = Vec<FacilityTerm>> {
        prop::collection::vec((any::<u32>(), -1e9f64..1e9, 0.0f64..1e6), 0..20).prop_map(|v| {
            v.into_iter()
                .map(|(facility, d, rho)| FacilityTerm { facility, d, rho })
                .collect()
        })
    }

    fn agent_msg() -> impl Strategy<Value = AgentMsg> {
        prop_oneof![
            (
                "[a-z0-9-]{0,20}",
                any::<u64>(),
                prop::collection::vec((any::<u32>(), any::<u32>()), 0..10),
                entries(),
                any::<u64>(),
                terms(),
            )
                .prop_map(
                    |(host, facility_digest, pairs, entries, last_iteration, last_d)| {
                        AgentMsg::Join(Join {
                            host,
                            facility_digest,
                            pairs,
                            entries: entries.clone(),
                            last_iteration,
                            last_d,
                            rank: last_iteration as u32,
                            interest: entries.iter().map(|e| e.0).collect(),
                            floor: entries,
                            exchanges: facility_digest as u32,
                        })
                    }
                ),
            (any::<u64>(), any::<u64>(), entries()).prop_map(|(epoch, iteration, entries)| {
                AgentMsg::Contribution(ContributionMsg {
                    epoch,
                    iteration,
                    entries,
                })
            }),
            any::<u64>().prop_map(|seq| AgentMsg::Heartbeat { seq }),
            Just(AgentMsg::Leave),
            (
                any::<u32>(),
                prop::option::of(entries()),
                prop::option::of(entries()),
            )
                .prop_map(|(exchange, park, activate)| {
                    AgentMsg::Proposal(ProposalMsg {
                        exchange,
                        park,
                        activate,
                    })
                }),
            (
                any::<u32>(),
                prop::collection::vec((any::<u32>(), any::<u32>()), 0..10),
                entries(),
                entries(),
            )
                .prop_map(|(exchange, pairs, floor, entries)| {
                    AgentMsg::Selected(SelectedMsg {
                        exchange,
                        pairs,
                        floor,
                        entries,
                    })
                }),
            any::<u64>().prop_map(|iteration| AgentMsg::Reselect { iteration }),
        ]
    }

    fn coord_msg() -> impl Strategy<Value = CoordMsg> {
        prop_oneof![
            (any::<u64>(), any::<u64>(), any::<u64>()).prop_map(|(epoch, iteration, hb)| {
                CoordMsg::Welcome {
                    epoch,
                    iteration,
                    heartbeat_ms: hb,
                    shard: Shard {
                        index: (hb % 4) as u32,
                        count: 4,
                    },
                }
            }),
            ".{0,40}".prop_map(|reason| CoordMsg::Refused { reason }),
            (any::<u64>(), any::<u64>(), terms()).prop_map(|(epoch, iteration, d)| {
                CoordMsg::Round {
                    epoch,
                    iteration,
                    d,
                }
            }),
            any::<u64>().prop_map(|seq| CoordMsg::HeartbeatAck { seq }),
            (
                any::<u32>(),
                any::<u32>(),
                entries(),
                0.0f64..1.0,
                any::<u64>()
            )
                .prop_map(|(exchange, round, prices, p, seed)| CoordMsg::Select {
                    exchange,
                    round,
                    prices,
                    options: SelectionParams {
                        swap_prob: p,
                        hysteresis: p / 10.0,
                        fairness: p / 50.0,
                        discount: 1.0 - p,
                        seed,
                    },
                }),
            (any::<u32>(), any::<bool>())
                .prop_map(|(exchange, activate)| CoordMsg::Verdict { exchange, activate }),
            (any::<u32>(), entries())
                .prop_map(|(exchange, prices)| CoordMsg::Restart { exchange, prices }),
            ("[a-z0-9-]{1,20}", 0.0f64..1e3)
                .prop_map(|(app, weight)| CoordMsg::SetWeight { app, weight }),
        ]
    }

    proptest! {
        #[test]
        fn agent_messages_round_trip(m in agent_msg()) {
            let f = encode(&m).unwrap();
            let mut dec = FrameDecoder::new();
            dec.push(&f);
            prop_assert_eq!(dec.next_msg::<AgentMsg>().unwrap(), Some(m));
        }

        #[test]
        fn coordinator_messages_round_trip(m in coord_msg()) {
            let f = encode(&m).unwrap();
            let mut dec = FrameDecoder::new();
            dec.push(&f);
            prop_assert_eq!(dec.next_msg::<CoordMsg>().unwrap(), Some(m));
        }

        #[test]
        fn arbitrary_bytes_never_panic_the_decoder(
            bytes in prop::collection::vec(any::<u8>(), 0..512),
            valid_header in any::<bool>(),
        ) {
            let mut input = Vec::new();
            if valid_header {
                input.extend_from_slice(&MAGIC);
                input.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
                input.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
            }
            input.extend_from_slice(&bytes);
            let mut a = FrameDecoder::new();
            a.push(&input);
            while let Ok(Some(_)) = a.next_msg::<AgentMsg>() {}
            let mut c = FrameDecoder::new();
            c.push(&input);
            while let Ok(Some(_)) = c.next_msg::<CoordMsg>() {}
        }
    }
}
