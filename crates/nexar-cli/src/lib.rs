//! The logic behind the `nexar` command-line tool, kept out of the binary so other
//! front ends (a multi-process `nexar worker`, integration tests) can reuse it.
//!
//! - [`run_smoke`] runs every [`Check`] on a set of communicators and reports a
//!   [`CheckResult`] per check. Each check is a per-rank async function, so a process
//!   that holds a single rank can run [`Check::run_rank`] on its own communicator.
//! - [`ClusterInfo`] describes an in-process cluster: its ranks, node ids and addresses.

mod info;
mod smoke;

pub use info::{ClusterInfo, RankInfo};
pub use smoke::{checks, run_check, run_smoke, Check, CheckResult, CHECK_TIMEOUT};
