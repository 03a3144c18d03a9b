//! softrnic: a software RDMA NIC for the stock rdma-core user space. Three crates:
//! `softrnic-provider` (the libibverbs provider and the RDMA connection manager,
//! `libsoftrnic_provider.so`, loaded into every verbs program), `softrnic-abi` (what the provider and the engine share: [`proto`],
//! [`ring`], [`device`], re-exported here), and this one, the engine and the command:
//!
//! - [`engine`]: the NIC engine of one emulated host;
//! - [`events`]: asynchronous events (`ibv_get_async_event`) and what a destroy waits for;
//! - [`faults`]: seeded per-link fault injection (loss, duplication, reordering, delay);
//! - [`mw`]: memory windows (type 1 and 2 binding, invalidation, remote access);
//! - [`auss`]: the active unique senders in the NIC's ACKs (the table through which a
//!   host's programs read each destination's `N` is `drum_table::nic_auss`, shared with the
//!   shim);
//! - [`nic`]: the NIC model (line rate, MTU, QP-context cache, WQE fetch cost);
//! - [`idmap`]: hash maps keyed by the engine's own numbers;
//! - [`hosts`]: emulated hosts (namespaces or loopback), `up`/`down`/`exec`/`addr`;
//! - [`userns`], [`devdir`]: hosts without root (a user namespace held by one process), and
//!   the private `/dev/infiniband` that `exec` mounts;
//! - [`due`]: items held until a time (the receive port's delay line, held faults);
//! - [`wire`]: the engine-engine packet format.
//!
//! See docs/softrnic.md.

pub use softrnic_abi::{device, proto, ring};

pub mod auss;
pub mod dart_receiver;
pub mod dcqcn;
pub mod devdir;
pub mod due;
pub mod engine;
pub mod events;
pub mod faults;
pub mod flow;
pub mod hosts;
pub mod idmap;
pub mod mw;
pub mod nic;
pub mod rx_port;
pub mod userns;
pub mod wire;
