//! Builds this crate, and only this crate, with `cfg(loom)`: the shim's files it includes
//! then use loom's atomics, cells and yield, while the shim itself keeps std's.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(loom)");
    println!("cargo::rustc-cfg=loom");
}
