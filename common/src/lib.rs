//! DRUM's pure core: the corrected model of docs/design.md §3, its optimisers and the instance
//! generator. Nothing here does I/O, spawns threads of its own (rayon aside) or reads clocks, so
//! the agent, the coordinator and the simulator can all reuse it and tests are deterministic.

#![forbid(unsafe_code)]

pub mod admm;
pub mod app_identity;
pub mod certificate;
pub mod dasr;
pub mod demand;
pub mod dual;
pub mod exact;
pub mod facility_prices;
pub mod generator;
pub mod host_step;
pub mod instance;
pub mod live;
pub mod lossy;
pub mod max_min;
pub mod model;
pub mod polish;
pub mod process_share;
pub mod protocol;
pub mod pruning;
pub mod qp_share;
pub mod rng;
pub mod roots;
pub mod selection;
pub mod solver;
pub mod trace;
pub mod traffic_shares;
pub mod utility;
pub mod xwi;
/// Lives in `drum-table` because the shim, which does not link this crate, needs it too.
pub use drum_table::wire_cost;
