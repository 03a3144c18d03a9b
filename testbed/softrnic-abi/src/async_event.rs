//! The record in which the engine hands an asynchronous event to libibverbs through a
//! context's `async_fd` (the engine's queue and its one-record-at-a-time rule are in
//! softrnic's `events`).

/// Size of `struct ib_uverbs_async_event_desc`.
pub const RECORD_LEN: usize = 16;

/// `struct ib_uverbs_async_event_desc { u64 element; u32 event_type; u32 reserved; }`.
pub fn record(element: u64, event_type: u32) -> [u8; RECORD_LEN] {
    let mut r = [0u8; RECORD_LEN];
    r[..8].copy_from_slice(&element.to_ne_bytes());
    r[8..12].copy_from_slice(&event_type.to_ne_bytes());
    r
}
