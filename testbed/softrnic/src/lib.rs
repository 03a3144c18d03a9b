//! softrnic: a software RDMA NIC for the stock rdma-core user space.
//!
//! - [`provider`]: the libibverbs provider (this crate's cdylib, `libsoftrnic.so`);
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
//! - [`rdma_cm`]: the RDMA connection manager behind `/dev/infiniband/rdma_cm`, for librdmacm;
//! - [`due`]: items held until a time (the receive port's delay line, held faults);
//! - [`ring`]: shared-memory work-request and completion rings, and the engine's doorbell;
//! - [`proto`], [`wire`], [`device`]: the provider-engine protocol, the
//!   engine-engine packet format, and what the device reports.
//!
//! See docs/softrnic.md.

pub mod auss;
pub mod dart_receiver;
pub mod dcqcn;
pub mod devdir;
pub mod device;
pub mod due;
pub mod engine;
pub mod events;
pub mod faults;
pub mod flow;
pub mod hosts;
pub mod idmap;
pub mod mw;
pub mod nic;
pub mod proto;
pub mod provider;
pub mod rdma_cm;
pub mod ring;
pub mod rx_port;
pub mod userns;
pub mod wire;
