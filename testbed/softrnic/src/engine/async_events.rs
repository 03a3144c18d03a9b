//! Asynchronous events (`ibv_get_async_event`): port and QP events queued per connection
//! and written to its event stream one record at a time, as the application reads them
//! ([`crate::events`]).

use super::*;

impl State {
    /// Raise an asynchronous event on connection `conn`'s event stream (dropped if the context
    /// has none, e.g. a provider that did not open one).
    pub(super) fn raise(&mut self, conn: u64, obj: Obj, element: u64, event_type: u32) {
        let Some((id, q)) = self.event_queue(conn) else {
            return;
        };
        if !q.push(obj, element, event_type) {
            eprintln!("softrnic engine: async event {event_type} dropped (queue full)");
        }
        self.pump_events(id);
    }

    /// The link went down or came up: every context of the host learns it from an
    /// asynchronous event (`IBV_EVENT_PORT_ERR`, `IBV_EVENT_PORT_ACTIVE`; element: port 1).
    /// QPs are left alone, as on hardware: their retransmissions fail while the link is down
    /// and run out after their retry count, or succeed once it is back.
    pub(super) fn set_port(&mut self, up: bool) {
        if up == self.fabric.up {
            return;
        }
        self.fabric.up = up;
        let event = if up {
            IBV_EVENT_PORT_ACTIVE
        } else {
            IBV_EVENT_PORT_ERR
        };
        let conns: Vec<u64> = self
            .channels
            .values()
            .filter(|c| c.events.is_some())
            .map(|c| c.conn)
            .collect();
        for conn in conns {
            self.raise(conn, Obj::Port, 1, event);
        }
    }

    /// The channel id and event queue of connection `conn`'s asynchronous event stream.
    pub(super) fn event_queue(&mut self, conn: u64) -> Option<(u32, &mut EventQueue)> {
        self.channels
            .iter_mut()
            .filter(|(_, c)| c.conn == conn)
            .find_map(|(&id, c)| Some((id, c.events.as_mut()?)))
    }

    /// An asynchronous event of a QP, for the application's `ibv_qp *`.
    pub(super) fn raise_qp(&mut self, qpn: u32, event_type: u32) {
        if let Some(q) = self.qps.get(&qpn) {
            let (conn, user) = (q.conn, q.user);
            self.raise(conn, Obj::Qp(qpn), user, event_type);
        }
    }

    /// Write the next record of event stream `id` if the application has read the last one.
    pub(super) fn pump_events(&mut self, id: u32) {
        let Some(ch) = self.channels.get_mut(&id) else {
            return;
        };
        let (Some(sink), Some(q)) = (ch.sink.as_ref(), ch.events.as_mut()) else {
            return;
        };
        if let Some(r) = q.next_record() {
            if !send_nowait(sink, &r) {
                // Only a closed or broken stream refuses 16 bytes into an empty socket.
                eprintln!("softrnic engine: async event lost");
                q.consumed(true);
            }
        }
    }

    /// The connection's event stream: the record on it is gone (read or taken back).
    pub(super) fn async_event_read(&mut self, conn: u64, taken_back: bool) -> Resp {
        let Some((id, q)) = self.event_queue(conn) else {
            return err(libc::EINVAL);
        };
        q.consumed(taken_back);
        self.pump_events(id);
        Resp::Unit
    }

    /// An object of connection `conn` is destroyed: its unread events go with it; the answer
    /// tells the provider what to wait for (see [`crate::events`]).
    pub(super) fn forget_events(&mut self, conn: u64, obj: Obj) -> Resp {
        let (events_reported, event_unread) = self
            .event_queue(conn)
            .map_or((0, false), |(_, q)| q.forget(obj));
        Resp::Destroyed {
            events_reported,
            event_unread,
        }
    }

    /// Make `s` the event stream of channel `id` (owned by process `pid`, proven by `token`).
    pub(super) fn attach_channel(&mut self, pid: i32, id: u32, token: u64, s: UnixStream) -> Resp {
        match self.channels.get_mut(&id) {
            Some(ch) if ch.pid == pid && ch.token == token && ch.sink.is_none() => {
                ch.sink = Some(s);
                // An event stream may have events waiting already.
                self.pump_events(id);
                Resp::Unit
            }
            _ => err(libc::EINVAL),
        }
    }
}
