//! The RDMA connection manager for softrnic devices: what the kernel's `rdma_cm` and
//! `rdma_ucm` modules do for a real RDMA NIC, so that unmodified librdmacm programs (perftest's
//! `-R`, `rping`, `ucmatose`, `udaddy`, `rdma_server`/`rdma_client`) run over softrnic.
//!
//! - [`abi`]: the command ABI librdmacm writes to `/dev/infiniband/rdma_cm`;
//! - [`msg`]: the messages two connection managers exchange;
//! - [`state`]: ids, their states and events, without I/O;
//! - `cdev`: the interposed device file and the TCP connections between programs.
//!
//! See docs/softrnic.md, "The RDMA connection manager".

pub mod abi;
mod cdev;
pub mod msg;
pub mod state;
