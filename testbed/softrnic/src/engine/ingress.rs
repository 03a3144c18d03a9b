//! The engine's side of the receive port ([`crate::rx_port`]): every packet that arrives
//! from another host passes the port before it is handled — after the time the queue ahead
//! of it needs, held meanwhile in the port's delay line, which the receiving thread empties
//! as packets fall due — and the pauses the port decides go back to their senders, which then
//! hold back their whole transmitter as a PFC-paused port does.

use super::*;
use crate::rx_port::Verdict;

/// The longest pause a sender honours: a pause that says more is treated as this much (a
/// forged or corrupt one must not stop a NIC for good; the model's own pauses are the
/// drain time of one buffer overflow, microseconds to a few milliseconds).
const MAX_PAUSE: Duration = Duration::from_millis(10);

impl State {
    /// A datagram of `len` bytes, decoded as `p`, arrived from another host at `now`.
    pub(super) fn arrive(&mut self, from: SocketAddr, mut p: Packet, len: usize, now: Instant) {
        if p.op == wire::OP_PAUSE {
            // A link-level frame: it does not queue behind data.
            return self.receive(from, p, now);
        }
        let wire_bytes = len as u64 + nic::L2_L4_OVERHEAD;
        match self.rx_port.arrive(now, from, wire_bytes) {
            Verdict::Drop => {}
            Verdict::Accept { mark, pause, wait } => {
                if let Some(hold) = pause {
                    // Straight onto the socket, ahead of queued data: a pause is a link-level
                    // frame, not a packet the arbiter schedules.
                    self.fabric.out.push((
                        from,
                        Packet {
                            op: wire::OP_PAUSE,
                            imm: hold.as_nanos().min(u32::MAX as u128) as u32,
                            ..Default::default()
                        },
                    ));
                }
                if mark {
                    // The CE codepoint, as the congested port sets it in the IP header.
                    p.ecn = wire::ECN_CE;
                }
                if wait.is_zero() && !self.rx_waiting.holds(from) {
                    self.take_in(from, p, mark, now);
                } else {
                    self.rx_waiting.push(from, now + wait, (p, mark));
                }
            }
        }
    }

    /// Hands on the packets whose wait in the receive port has passed at `now`; returns how
    /// many, and when the next one is due.
    pub(super) fn release_waiting(&mut self, now: Instant) -> (usize, Option<Instant>) {
        let mut n = 0;
        while let Some((from, (p, mark))) = self.rx_waiting.pop_due(now) {
            self.take_in(from, p, mark, now);
            n += 1;
        }
        (n, self.rx_waiting.next_due())
    }

    /// A packet leaves the receive port for the NIC's receive pipeline; `marked_here`: this
    /// port marked it.
    fn take_in(&mut self, from: SocketAddr, p: Packet, marked_here: bool, now: Instant) {
        if p.ecn == wire::ECN_CE {
            self.on_marked(from, &p, marked_here, now);
        }
        self.receive(from, p, now);
    }

    /// A pause from a receiver's port: nothing leaves this NIC for `imm` ns.
    pub(super) fn on_pause(&mut self, p: &Packet, now: Instant) {
        let hold = Duration::from_nanos(p.imm as u64).min(MAX_PAUSE);
        self.rx_port.counters.pauses_received += 1;
        self.nic.hold(now, hold);
    }
}
