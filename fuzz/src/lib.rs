//! What the fuzz targets in `fuzz_targets/` check, one function per decoder, and the seed
//! corpus, generated from the project's own encoders (docs/fuzzing.md).
//!
//! Every check is "decode or refuse, never panic, never allocate without bound" plus an
//! invariant that catches silent misreading: whatever a decoder accepts must survive
//! encode → decode unchanged, and a stream decoder must give the same result however its
//! input is split.

use std::io::Cursor;

use drum_common::admm::FacilityTerm;
use drum_common::dasr::wire::Sealed;
use drum_common::dasr::{DasrKey, Datagram, Guard, Refusal};
use drum_common::instance::Instance;
use drum_common::protocol::wire::{self, FrameDecoder, WireError};
use serde::de::DeserializeOwned;
use serde::Serialize;
use softrnic::auss::Stamp;
use softrnic::flow::FlowRule;
use softrnic::proto::{self, Req, Resp};
use softrnic::wire::{psn_add, psn_diff, Packet, PSN_MASK};
use softrnic_provider::rdma_cm::msg::Msg as CmMsg;

// ---------------------------------------------------------------------------------------------
// Control plane (drum_common::protocol::wire)
// ---------------------------------------------------------------------------------------------

/// Feeds `stream` to a [`FrameDecoder`] in pieces of `chunk` bytes, draining messages after
/// each piece; returns every message (re-encoded, so that NaNs compare) and how it ended.
fn drain_frames<M: DeserializeOwned + Serialize>(
    stream: &[u8],
    chunk: usize,
) -> (Vec<Vec<u8>>, Result<usize, WireError>) {
    let mut dec = FrameDecoder::new();
    let mut got = Vec::new();
    for piece in stream.chunks(chunk.max(1)) {
        dec.push(piece);
        loop {
            match dec.next_msg::<M>() {
                Ok(Some(m)) => got.push(wire::encode(&m).expect("a decoded message re-encodes")),
                Ok(None) => break,
                Err(e) => return (got, Err(e)),
            }
        }
    }
    (got, Ok(dec.buffered()))
}

/// One control-plane input: byte 0 picks a split size, the rest is a byte stream from a peer.
///
/// - the stream through a [`FrameDecoder`] whole and in pieces: same messages, same ending;
/// - the stream as one bare payload ([`wire::decode_payload`], no header), so the fuzzer
///   reaches bincode without first having to guess a header and a matching length;
/// - whatever decodes re-encodes to a frame that decodes to the same message.
pub fn control_frames<M: DeserializeOwned + Serialize>(data: &[u8]) {
    let Some((&split, stream)) = data.split_first() else {
        return;
    };
    let whole = drain_frames::<M>(stream, stream.len());
    let pieces = drain_frames::<M>(stream, split as usize % 17 + 1);
    assert_eq!(
        whole, pieces,
        "the split of the stream changed what was decoded"
    );
    for frame in &whole.0 {
        round_trip::<M>(frame);
    }
    if let Ok(m) = wire::decode_payload::<M>(stream) {
        round_trip::<M>(&wire::encode(&m).expect("a decoded message re-encodes"));
    }
    if let Some(h) = stream.first_chunk::<{ wire::HEADER_LEN }>() {
        if let Ok(len) = wire::parse_header(h) {
            assert!(len <= wire::MAX_FRAME);
        }
    }
}

/// `frame` (one encoded message) decodes to a message that encodes to `frame` again.
fn round_trip<M: DeserializeOwned + Serialize>(frame: &[u8]) {
    let mut dec = FrameDecoder::new();
    dec.push(frame);
    let m = dec
        .next_msg::<M>()
        .expect("an encoded message decodes")
        .expect("an encoded message is complete");
    assert_eq!(dec.buffered(), 0);
    assert_eq!(
        wire::encode(&m).unwrap(),
        frame,
        "encode∘decode is not the identity"
    );
}

// ---------------------------------------------------------------------------------------------
// softrnic engine ↔ engine packets (softrnic::wire)
// ---------------------------------------------------------------------------------------------

/// One UDP datagram as the engine's receive loop gets it: [`Packet::decode`], and what it
/// accepts re-encodes to the same bytes (the pad byte aside). Also the 24-bit PSN arithmetic the
/// receive path applies to the accepted PSNs, and the AUSS stamp an ACK or notification
/// carries ([`Stamp::decode`]: refused or re-encoded to itself, within the bound on `N`).
pub fn softrnic_packet(data: &[u8]) {
    if let Some(p) = Packet::decode(data) {
        if p.op == softrnic::wire::OP_AUSS
            || (p.op == softrnic::wire::OP_ACK && !p.payload.is_empty())
        {
            let max_n = p.imm;
            if let Ok(s) = Stamp::decode(&p.payload, max_n) {
                assert!(s.n <= max_n && s.incarnation != 0);
                assert_eq!(
                    s.encode(),
                    &p.payload[..],
                    "an accepted stamp does not re-encode"
                );
            }
        }
        assert!(p.psn <= PSN_MASK);
        // Byte 7 is the ECN field (two bits), re-encoded like every other.
        assert!(p.ecn <= softrnic::wire::ECN_CE);
        assert_eq!(
            p.encode(),
            data,
            "an accepted datagram does not re-encode to itself"
        );
        // Distances of up to half the PSN space survive the wrap.
        let n = p.offset & (PSN_MASK >> 1);
        assert_eq!(psn_diff(psn_add(p.psn, n), p.psn), n as i32);
        assert_eq!(psn_diff(p.psn, psn_add(p.psn, n)), -(n as i32));
    }
}

// ---------------------------------------------------------------------------------------------
// softrnic RDMA CM messages between programs (softrnic_provider::rdma_cm::msg)
// ---------------------------------------------------------------------------------------------

/// One framed RDMA CM message body as the connection reader gets it: [`CmMsg::decode`], and
/// what it accepts encodes back to the same body.
pub fn softrnic_cm_msg(data: &[u8]) {
    if let Ok(m) = CmMsg::decode(data) {
        let e = m.encode().expect("an accepted message encodes");
        assert_eq!(
            &e[2..],
            data,
            "an accepted message does not re-encode to itself"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// softrnic flow-steering rules (softrnic::flow)
// ---------------------------------------------------------------------------------------------

/// An application's `struct ibv_flow_attr` with its specs as the engine gets it
/// ([`FlowRule::parse`]); a rule that parses is then tried on the input's bytes after the rule,
/// as an Ethernet frame. A parsed rule parses the same from its own bytes alone.
pub fn softrnic_flow_attr(data: &[u8]) {
    let Ok((rule, len)) = FlowRule::parse_prefix(data) else {
        return;
    };
    assert_eq!(FlowRule::parse(&data[..len]).as_ref(), Ok(&rule));
    let _ = rule.matches(&data[len..]);
}

// ---------------------------------------------------------------------------------------------
// softrnic provider ↔ engine (softrnic::proto)
// ---------------------------------------------------------------------------------------------

/// A provider's byte stream as the engine's connection handler reads it: length-prefixed frames
/// ([`proto::read_frame`]), each decoded with [`Req::decode`]; plus the input as one bare
/// request body. An accepted request survives encode → decode.
pub fn softrnic_request(data: &[u8]) {
    check_request(data);
    let mut r = Cursor::new(data);
    while let Ok(body) = proto::read_frame(&mut r) {
        assert!(body.len() <= proto::MAX_FRAME);
        check_request(&body);
    }
}

fn check_request(body: &[u8]) {
    if let Ok(req) = Req::decode(body) {
        let again = Req::decode(&req.encode()).expect("an encoded request decodes");
        assert_eq!(again, req, "decode∘encode is not the identity");
    }
}

/// The requests whose response layouts differ (every other one is answered with a bare errno).
fn request_for(selector: u8) -> Req {
    match selector % 9 {
        0 => Req::AllocPd,
        1 => Req::RegMr {
            pd: 1,
            addr: 0x1000,
            len: 4096,
            access: 7,
        },
        2 => Req::CreateCq {
            cqe: 16,
            channel: 0,
            user: 0,
        },
        3 => Req::CreateChannel,
        4 => Req::CreateQp {
            pd: 1,
            send_cq: 1,
            recv_cq: 1,
            qp_type: 2,
            sq_sig_all: false,
            cap: Default::default(),
            srq: 0,
            xrcd: 0,
        },
        5 => Req::QueryQp { qpn: 1 },
        6 => Req::PollCq { cq: 1, max: 16 },
        7 => Req::CreateSrq {
            pd: 1,
            max_wr: 16,
            max_sge: 1,
            xrcd: 0,
            cq: 0,
        },
        _ => Req::DestroyQp { qpn: 1 },
    }
}

/// An engine's response body as the provider decodes it: byte 0 picks the request it answers,
/// the rest is the body ([`Resp::decode`]); an accepted response survives encode → decode.
pub fn softrnic_response(data: &[u8]) {
    let Some((&sel, body)) = data.split_first() else {
        return;
    };
    let req = request_for(sel);
    if let Ok(resp) = Resp::decode(&req, body) {
        let again = Resp::decode(&req, &resp.encode()).expect("an encoded response decodes");
        assert_eq!(again, resp, "decode∘encode is not the identity");
    }
}

// ---------------------------------------------------------------------------------------------
// Instance JSON (drum_common::instance)
// ---------------------------------------------------------------------------------------------

/// An instance file: parse and validate ([`Instance::into_problem`]); a valid one written back
/// out ([`Instance::from_problem`], [`Instance::to_json`]) loads and validates again, equal —
/// exactly if serde_json reads floats back exactly, else to within a few ulps (see
/// [`json_floats_round_trip`]).
pub fn instance_json(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(inst) = Instance::from_json(text) else {
        return;
    };
    if let Ok(problem) = inst.into_problem() {
        let out = Instance::from_problem(&problem);
        let back = Instance::from_json(&out.to_json()).expect("a written instance parses");
        if json_floats_round_trip() {
            assert_eq!(
                back, out,
                "an instance does not survive to_json → from_json"
            );
        } else {
            let (a, b) = (serde_json::to_value(&back), serde_json::to_value(&out));
            assert!(
                close(&a.unwrap(), &b.unwrap()),
                "an instance does not survive to_json → from_json (beyond float rounding):\n\
                 {back:?}\n{out:?}"
            );
        }
        back.into_problem()
            .expect("a written valid instance validates");
    }
}

/// Whether serde_json reads back what it writes for every f64. Without its `float_roundtrip`
/// feature it does not: `1.3333333333333335` (its own output for 0x3ff5555555555556) reads as
/// 1.3333333333333337 (docs/fuzzing.md, findings). The instance check is exact once a crate of
/// the build enables that feature.
pub fn json_floats_round_trip() -> bool {
    static EXACT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *EXACT.get_or_init(|| {
        let x = f64::from_bits(0x3ff5_5555_5555_5556);
        serde_json::from_str::<f64>(&serde_json::to_string(&x).unwrap()).unwrap() == x
    })
}

/// Equal JSON values, numbers to within 8 ulps.
fn close(a: &serde_json::Value, b: &serde_json::Value) -> bool {
    use serde_json::Value as V;
    match (a, b) {
        (V::Number(x), V::Number(y)) => match (x.as_f64(), y.as_f64()) {
            (Some(x), Some(y)) if x.is_finite() && y.is_finite() && x.signum() == y.signum() => {
                x == y || x.to_bits().abs_diff(y.to_bits()) <= 8
            }
            _ => x == y,
        },
        (V::Array(x), V::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| close(x, y))
        }
        (V::Object(x), V::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| close(v, w)))
        }
        _ => a == b,
    }
}

// ---------------------------------------------------------------------------------------------
// DASR datagrams between agents (drum_common::dasr::wire, drum_common::dasr::auth)
// ---------------------------------------------------------------------------------------------

/// The key of the version-2 DASR seeds and of the target's guards.
const DASR_KEY: [u8; 32] = [7; 32];
/// The wall clock the DASR target opens at; the v2 seeds are stamped with it.
const DASR_NOW: std::time::Duration = std::time::Duration::from_secs(1_790_000_000);

fn dasr_guard() -> Guard {
    Guard::new(
        DasrKey::new(&DASR_KEY),
        None,
        std::time::Duration::from_secs(2),
    )
}

/// One datagram on an agent's DASR socket: [`Datagram::decode`] as a keyless agent decodes it
/// (version 1), [`Sealed::split`] and [`Guard::open`] (MAC, window, replay rule) as a keyed one
/// does (version 2). Whatever a keyless agent accepts, sealed with the key, opens to the same
/// datagram exactly once, and is itself refused by a keyed agent as unauthenticated.
pub fn dasr_datagram(data: &[u8]) {
    if let Ok(s) = Sealed::split(data) {
        let _ = s.datagram();
    }
    let _ = dasr_guard().open(DASR_NOW, data);
    if let Ok(d) = Datagram::decode(data) {
        assert_eq!(
            d.encode(),
            data,
            "an accepted datagram does not re-encode to itself"
        );
        let sealed = dasr_guard().seal(DASR_NOW, &d);
        let mut rx = dasr_guard();
        assert_eq!(rx.open(DASR_NOW, &sealed), Ok(d));
        assert_eq!(rx.open(DASR_NOW, &sealed), Err(Refusal::Replay));
        assert_eq!(
            dasr_guard().open(DASR_NOW, data),
            Err(Refusal::Unauthenticated)
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Seeds
// ---------------------------------------------------------------------------------------------

mod seeds;
pub use seeds::seeds;

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    /// Every committed regression input (fuzz/regressions/TARGET/: inputs that once failed a
    /// check) passes its target's checks now.
    #[test]
    fn regressions_pass() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("regressions");
        let Ok(dirs) = std::fs::read_dir(&root) else {
            return;
        };
        for dir in dirs {
            let dir = dir.unwrap().path();
            let target = dir.file_name().unwrap().to_str().unwrap().to_owned();
            for f in std::fs::read_dir(&dir).unwrap() {
                let bytes = std::fs::read(f.unwrap().path()).unwrap();
                match target.as_str() {
                    "control_agent_frames" => control_frames::<wire::AgentMsg>(&bytes),
                    "control_coord_frames" => control_frames::<wire::CoordMsg>(&bytes),
                    "softrnic_packet" => softrnic_packet(&bytes),
                    "softrnic_cm_msg" => softrnic_cm_msg(&bytes),
                    "softrnic_flow_attr" => softrnic_flow_attr(&bytes),
                    "softrnic_request" => softrnic_request(&bytes),
                    "softrnic_response" => softrnic_response(&bytes),
                    "instance_json" => instance_json(&bytes),
                    "dasr_datagram" => dasr_datagram(&bytes),
                    _ => {}
                }
            }
        }
    }

    /// The committed corpus is what [`seeds`] makes (so a format change shows up here), and
    /// every seed passes its target's checks. `FUZZ_WRITE_SEEDS=1` rewrites the corpus.
    #[test]
    fn committed_seeds_are_current() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
        let write = std::env::var_os("FUZZ_WRITE_SEEDS").is_some();
        for (target, name, bytes) in seeds() {
            match target {
                "control_agent_frames" => {
                    control_frames::<wire::AgentMsg>(&bytes);
                    assert!(bytes.len() > 1);
                }
                "control_coord_frames" => control_frames::<wire::CoordMsg>(&bytes),
                "softrnic_packet" => {
                    assert!(Packet::decode(&bytes).is_some());
                    softrnic_packet(&bytes);
                }
                "softrnic_cm_msg" => {
                    assert!(CmMsg::decode(&bytes).is_ok());
                    softrnic_cm_msg(&bytes);
                }
                "softrnic_flow_attr" => {
                    let r = FlowRule::parse(&bytes).expect("the seed rule parses");
                    assert!(r.matches(&bytes[100..]), "the seed frame matches");
                    softrnic_flow_attr(&bytes);
                }
                "softrnic_request" => softrnic_request(&bytes),
                "softrnic_response" => softrnic_response(&bytes),
                "instance_json" => {
                    let i = Instance::from_json(std::str::from_utf8(&bytes).unwrap()).unwrap();
                    i.into_problem().unwrap();
                    instance_json(&bytes);
                }
                "dasr_datagram" => {
                    let v1 = Datagram::decode(&bytes).is_ok();
                    let v2 = dasr_guard().open(DASR_NOW, &bytes).is_ok();
                    assert!(v1 || v2, "a DASR seed opens as v1 or as v2");
                    dasr_datagram(&bytes);
                }
                "daemon_config" => {}
                other => panic!("seed for unknown target {other}"),
            }
            let path = root.join(target).join(name);
            if write {
                std::fs::create_dir_all(path.parent().unwrap()).unwrap();
                std::fs::write(&path, &bytes).unwrap();
            } else {
                let on_disk = std::fs::read(&path)
                    .unwrap_or_else(|e| panic!("{}: {e} (FUZZ_WRITE_SEEDS=1)", path.display()));
                assert_eq!(
                    on_disk,
                    bytes,
                    "{} is stale (FUZZ_WRITE_SEEDS=1)",
                    path.display()
                );
            }
        }
    }
}
