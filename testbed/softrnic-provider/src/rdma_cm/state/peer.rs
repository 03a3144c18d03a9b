//! What the peer's connection manager says (its messages, or its loss), as events on the ids.

use super::*;

impl Cm {
    /// A message from the peer over id `h`'s connection.
    pub fn on_msg(&mut self, h: Handle, m: Msg) {
        let Some(id) = self.ids.get_mut(&h) else {
            return;
        };
        match (id.state, m) {
            (State::ReqSent, Msg::Rep(rep)) if !id.ud() => {
                id.remote = Some(Remote {
                    qpn: rep.qpn,
                    psn: rep.psn,
                    gid: rep.gid,
                    retry_count: id.local.retry_count,
                    rnr_retry_count: rep.rnr_retry_count,
                });
                id.state = State::RepRcvd;
                let param = Param::Conn(ConnParam {
                    qp_num: rep.qpn,
                    qkey: 0,
                    srq: rep.srq,
                    responder_resources: rep.initiator_depth,
                    initiator_depth: rep.responder_resources,
                    flow_control: rep.flow_control,
                    retry_count: 0,
                    rnr_retry_count: rep.rnr_retry_count,
                    private: msg::padded(&rep.private, msg::REP_PRIVATE),
                });
                self.event(h, event::CONNECT_RESPONSE, 0, param);
            }
            (State::ReqSent, Msg::Rej { reason, private }) if !id.ud() => {
                id.state = State::Rejected;
                self.out.push(Out::Close(h));
                self.rejected(h, reason as i32, &private);
            }
            (
                State::ReqSent,
                Msg::SidrRep {
                    status,
                    qpn,
                    qkey,
                    gid,
                    private,
                },
            ) if id.ud() => {
                self.out.push(Out::Close(h));
                if status != 0 {
                    id.state = State::Rejected;
                    self.event(h, event::UNREACHABLE, status as i32, Param::None);
                    return;
                }
                id.state = State::Established;
                let param = Param::Ud {
                    qp_num: qpn,
                    qkey,
                    ah: Some(ah_to(gid, id.tos)),
                    private: msg::padded(&private, msg::SIDR_REP_PRIVATE),
                };
                self.event(h, event::ESTABLISHED, 0, param);
            }
            (State::RepSent, Msg::Rtu) => {
                id.state = State::Established;
                self.event(h, event::ESTABLISHED, 0, Param::Conn(ConnParam::default()));
            }
            (State::Established | State::RepRcvd | State::RepSent, Msg::Dreq) => {
                id.state = State::DreqRcvd;
                self.event(h, event::DISCONNECTED, 0, Param::Conn(ConnParam::default()));
            }
            (State::DreqSent, m @ (Msg::Dreq | Msg::Drep)) => {
                id.state = State::Disconnected;
                if m == Msg::Dreq {
                    self.out.push(Out::Send(h, Msg::Drep));
                }
                self.out.push(Out::Close(h));
                self.event(h, event::DISCONNECTED, 0, Param::Conn(ConnParam::default()));
            }
            (State::Disconnected | State::Rejected | State::DreqRcvd, _) => {}
            _ => self.on_lost(h),
        }
    }

    /// The id's connection closed or failed, or the peer broke the protocol.
    pub fn on_lost(&mut self, h: Handle) {
        let Some(id) = self.ids.get_mut(&h) else {
            return;
        };
        let (state, ud) = (id.state, id.ud());
        match state {
            State::ReqSent => {
                id.state = State::Rejected;
                self.event(h, event::UNREACHABLE, -libc::ECONNRESET, Param::None);
            }
            State::ReqRcvd if !ud => {
                id.state = State::Rejected;
                self.rejected(h, REJ_CONSUMER_DEFINED as i32, &[]);
            }
            State::RepSent => {
                id.state = State::Rejected;
                self.event(h, event::UNREACHABLE, -libc::ETIMEDOUT, Param::None);
            }
            State::RepRcvd | State::Established | State::DreqSent if !ud => {
                id.state = if state == State::DreqSent {
                    State::Disconnected
                } else {
                    State::DreqRcvd
                };
                self.event(h, event::DISCONNECTED, 0, Param::Conn(ConnParam::default()));
            }
            _ => return,
        }
        self.out.push(Out::Close(h));
    }
}
