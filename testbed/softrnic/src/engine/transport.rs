//! A QP's transport, the state it owns as a requester and as a responder. It is pure: no
//! I/O, no clock (every entry takes `now`), no other QP's or the NIC's state. The engine's
//! `requester` and `responder` modules drive it: they resolve and read the applications'
//! memory, charge the NIC model, send packets and post the completions it hands back.

pub(super) mod requester;
pub(super) mod responder;

#[cfg(test)]
mod tests;
