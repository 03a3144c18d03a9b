//! What softrnic's two halves share, and nothing else: the provider loaded into every verbs
//! program (`softrnic-provider`, `libsoftrnic_provider.so`) and the NIC engine of its host
//! (`softrnic`).
//!
//! - [`proto`]: the requests the provider sends over the engine's Unix socket, and the answers;
//! - [`ring`]: the shared-memory work-request and completion rings, and the engine's doorbell;
//! - [`device`]: what the device reports (limits, attributes, GIDs, the sysfs tree's names);
//! - [`async_event`]: the record an asynchronous event is read as.
//!
//! See docs/softrnic.md.

pub mod async_event;
pub mod device;
pub mod proto;
pub mod ring;
