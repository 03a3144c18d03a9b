//! The messages two connection managers exchange (the roles of the IB CM's REQ, REP, RTU, REJ,
//! DREQ, DREP and SIDR REQ/REP MADs), framed for a TCP stream: a 2-byte big-endian body length,
//! then the body. Decoding checks every length; anything malformed is an error, never a panic.

/// What a body may hold at most: the largest message (a REP with 196 bytes of private data)
/// is far below it.
pub const MAX_BODY: usize = 512;

/// Private data the IB CM carries per message, after rdma_cm's 36-byte header where it has
/// one: the most a user may send, and what a receiver is given (padded with zeros, as a MAD's
/// fixed-size field arrives).
pub const REQ_PRIVATE: usize = 56;
pub const REP_PRIVATE: usize = 196;
pub const REJ_PRIVATE: usize = 148;
pub const SIDR_REQ_PRIVATE: usize = 180;
pub const SIDR_REP_PRIVATE: usize = 136;

/// A connection request: the requester's QP and what it asks of the responder.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Req {
    pub qpn: u32,
    pub psn: u32,
    pub gid: [u8; 16],
    pub srq: bool,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub flow_control: u8,
    pub retry_count: u8,
    pub rnr_retry_count: u8,
    pub private: Vec<u8>,
}

/// The responder's answer to a [`Req`] it accepts.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Rep {
    pub qpn: u32,
    pub psn: u32,
    pub gid: [u8; 16],
    pub srq: bool,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub flow_control: u8,
    pub rnr_retry_count: u8,
    pub private: Vec<u8>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Msg {
    Req(Req),
    Rep(Rep),
    /// Ready to use: the requester took the [`Rep`].
    Rtu,
    Rej {
        reason: u8,
        private: Vec<u8>,
    },
    Dreq,
    Drep,
    /// A UD service lookup: the requester's GID, so the responder can address it.
    SidrReq {
        gid: [u8; 16],
        private: Vec<u8>,
    },
    SidrRep {
        status: u8,
        qpn: u32,
        qkey: u32,
        gid: [u8; 16],
        private: Vec<u8>,
    },
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum MsgError {
    #[error("message truncated")]
    Truncated,
    #[error("unknown message type {0}")]
    UnknownType(u8),
    #[error("private data of {len} bytes where at most {max} fit")]
    PrivateTooLong { len: usize, max: usize },
    #[error("flag byte {0} (0 or 1)")]
    BadFlag(u8),
    #[error("{0} bytes left after the message")]
    Trailing(usize),
    #[error("body of {0} bytes (at most {MAX_BODY})")]
    BodyTooLong(usize),
}

const T_REQ: u8 = 1;
const T_REP: u8 = 2;
const T_RTU: u8 = 3;
const T_REJ: u8 = 4;
const T_DREQ: u8 = 5;
const T_DREP: u8 = 6;
const T_SIDR_REQ: u8 = 7;
const T_SIDR_REP: u8 = 8;

impl Msg {
    /// The most private data this kind of message carries.
    pub fn private_max(&self) -> usize {
        match self {
            Msg::Req(_) => REQ_PRIVATE,
            Msg::Rep(_) => REP_PRIVATE,
            Msg::Rej { .. } => REJ_PRIVATE,
            Msg::SidrReq { .. } => SIDR_REQ_PRIVATE,
            Msg::SidrRep { .. } => SIDR_REP_PRIVATE,
            Msg::Rtu | Msg::Dreq | Msg::Drep => 0,
        }
    }

    fn private(&self) -> &[u8] {
        match self {
            Msg::Req(r) => &r.private,
            Msg::Rep(r) => &r.private,
            Msg::Rej { private, .. }
            | Msg::SidrReq { private, .. }
            | Msg::SidrRep { private, .. } => private,
            Msg::Rtu | Msg::Dreq | Msg::Drep => &[],
        }
    }

    /// The framed message: length prefix and body.
    pub fn encode(&self) -> Result<Vec<u8>, MsgError> {
        let (len, max) = (self.private().len(), self.private_max());
        if len > max {
            return Err(MsgError::PrivateTooLong { len, max });
        }
        let mut b = vec![0, 0];
        match self {
            Msg::Req(r) => {
                b.push(T_REQ);
                b.extend_from_slice(&r.qpn.to_be_bytes());
                b.extend_from_slice(&r.psn.to_be_bytes());
                b.extend_from_slice(&r.gid);
                b.extend_from_slice(&[
                    r.srq as u8,
                    r.responder_resources,
                    r.initiator_depth,
                    r.flow_control,
                    r.retry_count,
                    r.rnr_retry_count,
                ]);
            }
            Msg::Rep(r) => {
                b.push(T_REP);
                b.extend_from_slice(&r.qpn.to_be_bytes());
                b.extend_from_slice(&r.psn.to_be_bytes());
                b.extend_from_slice(&r.gid);
                b.extend_from_slice(&[
                    r.srq as u8,
                    r.responder_resources,
                    r.initiator_depth,
                    r.flow_control,
                    r.rnr_retry_count,
                ]);
            }
            Msg::Rtu => b.push(T_RTU),
            Msg::Rej { reason, .. } => b.extend_from_slice(&[T_REJ, *reason]),
            Msg::Dreq => b.push(T_DREQ),
            Msg::Drep => b.push(T_DREP),
            Msg::SidrReq { gid, .. } => {
                b.push(T_SIDR_REQ);
                b.extend_from_slice(gid);
            }
            Msg::SidrRep {
                status,
                qpn,
                qkey,
                gid,
                ..
            } => {
                b.extend_from_slice(&[T_SIDR_REP, *status]);
                b.extend_from_slice(&qpn.to_be_bytes());
                b.extend_from_slice(&qkey.to_be_bytes());
                b.extend_from_slice(gid);
            }
        }
        if max > 0 {
            b.push(len as u8);
            b.extend_from_slice(self.private());
        }
        let body = (b.len() - 2) as u16;
        b[..2].copy_from_slice(&body.to_be_bytes());
        Ok(b)
    }

    /// One message from a body (the bytes after the length prefix).
    pub fn decode(body: &[u8]) -> Result<Msg, MsgError> {
        if body.len() > MAX_BODY {
            return Err(MsgError::BodyTooLong(body.len()));
        }
        let mut r = Reader(body);
        let t = r.u8()?;
        let mut m = match t {
            T_REQ => Msg::Req(Req {
                qpn: r.u32()?,
                psn: r.u32()?,
                gid: r.gid()?,
                srq: r.flag()?,
                responder_resources: r.u8()?,
                initiator_depth: r.u8()?,
                flow_control: r.u8()?,
                retry_count: r.u8()?,
                rnr_retry_count: r.u8()?,
                private: Vec::new(),
            }),
            T_REP => Msg::Rep(Rep {
                qpn: r.u32()?,
                psn: r.u32()?,
                gid: r.gid()?,
                srq: r.flag()?,
                responder_resources: r.u8()?,
                initiator_depth: r.u8()?,
                flow_control: r.u8()?,
                rnr_retry_count: r.u8()?,
                private: Vec::new(),
            }),
            T_RTU => Msg::Rtu,
            T_REJ => Msg::Rej {
                reason: r.u8()?,
                private: Vec::new(),
            },
            T_DREQ => Msg::Dreq,
            T_DREP => Msg::Drep,
            T_SIDR_REQ => Msg::SidrReq {
                gid: r.gid()?,
                private: Vec::new(),
            },
            T_SIDR_REP => Msg::SidrRep {
                status: r.u8()?,
                qpn: r.u32()?,
                qkey: r.u32()?,
                gid: r.gid()?,
                private: Vec::new(),
            },
            other => return Err(MsgError::UnknownType(other)),
        };
        let max = m.private_max();
        if max > 0 {
            let len = r.u8()? as usize;
            if len > max {
                return Err(MsgError::PrivateTooLong { len, max });
            }
            let p = r.take(len)?.to_vec();
            match &mut m {
                Msg::Req(x) => x.private = p,
                Msg::Rep(x) => x.private = p,
                Msg::Rej { private, .. }
                | Msg::SidrReq { private, .. }
                | Msg::SidrRep { private, .. } => *private = p,
                Msg::Rtu | Msg::Dreq | Msg::Drep => {}
            }
        }
        if !r.0.is_empty() {
            return Err(MsgError::Trailing(r.0.len()));
        }
        Ok(m)
    }
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], MsgError> {
        if self.0.len() < n {
            return Err(MsgError::Truncated);
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, MsgError> {
        Ok(self.take(1)?[0])
    }
    fn flag(&mut self) -> Result<bool, MsgError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(MsgError::BadFlag(b)),
        }
    }
    fn u32(&mut self) -> Result<u32, MsgError> {
        Ok(u32::from_be_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn gid(&mut self) -> Result<[u8; 16], MsgError> {
        Ok(self.take(16)?.try_into().expect("16 bytes"))
    }
}

/// Private data as the receiver of a message sees it: the sender's bytes, zero-padded to the
/// message's fixed size.
pub fn padded(private: &[u8], size: usize) -> Vec<u8> {
    let mut p = private.to_vec();
    p.resize(size.max(p.len()), 0);
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples() -> Vec<Msg> {
        vec![
            Msg::Req(Req {
                qpn: 0x12,
                psn: 0xabcdef,
                gid: [7; 16],
                srq: true,
                responder_resources: 4,
                initiator_depth: 2,
                flow_control: 1,
                retry_count: 7,
                rnr_retry_count: 6,
                private: vec![1; REQ_PRIVATE],
            }),
            Msg::Rep(Rep {
                qpn: 3,
                psn: 9,
                private: b"hello".to_vec(),
                ..Rep::default()
            }),
            Msg::Rtu,
            Msg::Rej {
                reason: 28,
                private: vec![],
            },
            Msg::Dreq,
            Msg::Drep,
            Msg::SidrReq {
                gid: [1; 16],
                private: vec![5; 3],
            },
            Msg::SidrRep {
                status: 0,
                qpn: 44,
                qkey: UDP_QKEY_FOR_TEST,
                gid: [2; 16],
                private: vec![],
            },
        ]
    }
    const UDP_QKEY_FOR_TEST: u32 = 0x0123_4567;

    #[test]
    fn every_message_round_trips() {
        for m in samples() {
            let b = m.encode().unwrap();
            let len = u16::from_be_bytes([b[0], b[1]]) as usize;
            assert_eq!(len, b.len() - 2);
            assert_eq!(Msg::decode(&b[2..]).unwrap(), m);
        }
    }

    #[test]
    fn truncations_and_extensions_are_errors() {
        for m in samples() {
            let b = m.encode().unwrap();
            for cut in 0..b.len() - 2 {
                assert!(Msg::decode(&b[2..2 + cut]).is_err(), "{m:?} cut at {cut}");
            }
            let mut longer = b[2..].to_vec();
            longer.push(0);
            assert_eq!(Msg::decode(&longer), Err(MsgError::Trailing(1)));
        }
        assert_eq!(Msg::decode(&[99]), Err(MsgError::UnknownType(99)));
        let mut req = Msg::Req(Req::default()).encode().unwrap()[2..].to_vec();
        req[25] = 2; // the SRQ flag
        assert_eq!(Msg::decode(&req), Err(MsgError::BadFlag(2)));
        assert_eq!(
            Msg::decode(&[0; MAX_BODY + 1]),
            Err(MsgError::BodyTooLong(MAX_BODY + 1))
        );
    }

    #[test]
    fn private_data_beyond_the_message_size_is_refused() {
        let m = Msg::Req(Req {
            private: vec![0; REQ_PRIVATE + 1],
            ..Req::default()
        });
        assert_eq!(
            m.encode(),
            Err(MsgError::PrivateTooLong {
                len: REQ_PRIVATE + 1,
                max: REQ_PRIVATE
            })
        );
        // A length byte claiming more than the type allows.
        let mut b = Msg::Rej {
            reason: 1,
            private: vec![],
        }
        .encode()
        .unwrap()[2..]
            .to_vec();
        *b.last_mut().unwrap() = 200;
        b.extend(std::iter::repeat_n(0, 200));
        assert_eq!(
            Msg::decode(&b),
            Err(MsgError::PrivateTooLong {
                len: 200,
                max: REJ_PRIVATE
            })
        );
        assert_eq!(padded(b"ab", 4), b"ab\0\0");
    }
}
