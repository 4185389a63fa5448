//! The logic behind the `nexar` command-line tool, kept out of the binary so other
//! front ends (integration tests, other launchers) can reuse it.
//!
//! - [`run_smoke`] runs every [`Check`] on a set of communicators and reports a
//!   [`CheckResult`] per check. Each check is a per-rank async function, so a process
//!   that holds a single rank runs [`run_smoke_rank`] on its own communicator.
//! - [`ClusterInfo`] describes a cluster: its ranks, node ids and addresses.
//! - [`run_bench`] and [`run_bench_rank`] measure every collective and the transport
//!   itself, nccl-tests style, into one [`BenchRow`] per operation and size.
//! - [`wait_formed_with_progress`], [`mesh_addr`] and [`node_info`] serve the
//!   multi-process commands, `nexar seed` and `nexar worker`.

// Library code: no `expect` where a peer's bytes or a caller's input could make it fail
// (the workspace lints `unwrap_used` everywhere; tests may expect).
#![warn(clippy::expect_used)]
#![cfg_attr(test, allow(clippy::expect_used))]

/// `eprintln!` that drops what a closed standard error will not take: `eprintln!` panics
/// there (Rust ignores SIGPIPE, so the write fails with EPIPE), which would stop a seed
/// mid-formation or a worker mid-job whose `2>&1 | head` reader has gone.
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

mod benchmark;
mod elastic;
mod info;
mod multi;
mod smoke;
mod soak;

pub use benchmark::{
    parse_dtype, parse_ops, parse_size, run_bench, run_bench_rank, sizes, BenchOp, BenchOptions,
    BenchRow,
};
pub use elastic::{elastic_rank, ElasticOptions, ElasticOutcome};
pub use info::{ClusterInfo, RankInfo};
pub use multi::{
    mesh_addr, node_info, wait_finished_with_progress, wait_formed_with_progress, Advertise,
    PROGRESS_POLL,
};
pub use smoke::{checks, run_check, run_smoke, run_smoke_rank, Check, CheckResult, CHECK_TIMEOUT};
pub use soak::{soak_config, soak_rank, SoakOutcome};
