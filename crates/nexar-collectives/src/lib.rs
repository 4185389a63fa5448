//! Sans-IO collective algorithms for nexar, and a deterministic simulator to run them.
//!
//! A collective on one rank is a [`Schedule`]: a state machine that, polled, hands out
//! [`Action`]s ("send this byte range to peer p as message s", "receive message s from
//! peer q and reduce it into this range", local copies and reductions) and is told when
//! each one completes. The constructors ([`all_reduce`], [`broadcast`], ...) validate their
//! arguments and pick an algorithm by size and world size ([`CollectiveConfig`]).
//! Nothing here does I/O: a driver (nexar-actors, or [`SimNet`] in tests) moves the bytes.
//!
//! Gradient compression ([`Codec`], [`compress_with_feedback`], [`encode`], [`decode`],
//! [`accumulate`]) turns an all-reduce into an all-gather of sparse encodings.
//!
//! # Driver contract
//!
//! - Allocate [`Schedule::scratch_len`] bytes of [`BufId::Scratch`] (contents
//!   unspecified), then [`poll`](Schedule::poll) once; a schedule may already be
//!   [`done`](Schedule::is_done) (one rank, or nothing to move). After every
//!   [`complete`](Schedule::complete), poll again, until done.
//! - Actions handed out together may run in any order and concurrently; the schedule has
//!   already ordered everything that touches the same bytes. A send may complete as soon
//!   as its bytes are copied out.
//! - Messages are identified by (collective, sender, `step`); they can arrive early and
//!   in any order, and must be kept until the matching receive is posted.
//! - A driver may hand a send the bytes of the receive it
//!   [`forwards`](Schedule::forwards) instead of copying its range out, and may leave a
//!   reduced result [`only_forwarded`](Schedule::only_forwarded) unwritten once it does.
//!   It may likewise build a send's message from its [`parts`](Schedule::parts): the
//!   payloads of the receives they name, and copies of the rest.
//! - Reductions (`Recv { reduce: true }`, with or without a `base`, and `Reduce`) apply
//!   the collective's op with
//!   [`nexar_device::reduce_bytes`], where [`ReduceOp::Avg`](nexar_device::ReduceOp::Avg)
//!   acts as a sum; when a schedule is done the driver divides with
//!   [`nexar_device::finalize_bytes`] (divisor `world`) on: the whole `Data` for
//!   [`all_reduce`] and [`reduce_scatter`], only block `rank` of `Data` for
//!   [`reduce_scatter_in_place`] (the other blocks keep the caller's values), the root's
//!   `Data` for [`reduce`] (or divides each rank's contribution before the schedule
//!   runs and not after, as `nexar-actors` does for `f16`, whose sums overflow where
//!   means do not). `FillIdentity` uses [`nexar_device::fill_identity`].
//!
//! Buffer sizes, in elements (`n` is the count argument, `w` the world size):
//!
//! | collective | `Data` | `Input` |
//! |---|---|---|
//! | [`all_reduce`], [`broadcast`], [`scan`] | `n` | empty |
//! | [`reduce`] | `n` (only the root's changes) | empty |
//! | [`all_gather`] | `n * w` | `n` |
//! | [`reduce_scatter`] | `n` | `n * w` |
//! | [`gather`] | root: `n * w`, others: empty | `n` |
//! | [`scatter`] | `n` | root: `n * w`, others: empty |
//! | [`all_to_all`] | `n * w` | `n * w` |
//! | [`barrier`] | empty | empty |
//!
//! ```
//! use nexar_collectives::{all_reduce, CollectiveConfig, RankBuffers, SimNet};
//! use nexar_device::{DataType, ReduceOp};
//!
//! let world = 3;
//! let cfg = CollectiveConfig::default();
//! let schedules = (0..world)
//!     .map(|r| all_reduce(r, world, 2, DataType::I32, ReduceOp::Sum, &cfg))
//!     .collect::<Result<Vec<_>, _>>()?;
//! let buffers = (0..world as i32)
//!     .map(|r| RankBuffers::new(bytes(&[r, 10 * r]), Vec::new()))
//!     .collect();
//! let out = SimNet::new(7).run(DataType::I32, ReduceOp::Sum, schedules, buffers)?;
//! for rank in &out.ranks {
//!     assert_eq!(rank.data, bytes(&[3, 30]));
//! }
//! # fn bytes(v: &[i32]) -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

// Library code: no `expect` where a peer's bytes or a caller's input could make it fail
// (the workspace lints `unwrap_used` everywhere; tests may expect).
#![warn(clippy::expect_used)]
#![cfg_attr(test, allow(clippy::expect_used))]

mod action;
mod algos;
mod api;
mod codec;
mod config;
mod dag;
mod error;
mod layout;
mod sim;

pub use action::{Action, BufId, BufRange, OpId, Schedule, SendPart};
pub use api::{
    all_gather, all_gather_in_place, all_reduce, all_to_all, barrier, broadcast, gather, reduce,
    reduce_scatter, reduce_scatter_in_place, scan, scatter,
};
pub use codec::{
    accumulate, compress, compress_with_feedback, decode, encode, Codec, CodecError,
    CompressElement, Ratio, Residual, Sparse, WideFloat,
};
pub use config::{Algorithm, CollectiveConfig};
pub use dag::DagSchedule;
pub use error::ScheduleError;

/// The largest world a schedule is built for (2^24 ranks): its messages' step numbers,
/// and its rounds, are counted for worlds up to this; a larger one is refused
/// ([`ScheduleError::WorldTooLarge`]) rather than numbered wrong. (A world near `usize`'s
/// range made the barrier's doubling distance wrap to 0 and loop for good.)
pub const MAX_WORLD: usize = 1 << 24;
pub use sim::{RankBuffers, SimError, SimNet, SimOutput, SimStats};
