//! [`ScheduleError`]: bad arguments to a schedule constructor, and misuse of a schedule.

use nexar_device::{DataType, DeviceError, ReduceOp};

use crate::OpId;

/// An error building or driving a [`Schedule`](crate::Schedule).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ScheduleError {
    /// The communicator has no ranks.
    #[error("world size must be at least 1")]
    EmptyWorld,
    /// The communicator has more ranks than a schedule numbers its messages for
    /// ([`MAX_WORLD`](crate::MAX_WORLD)).
    #[error("world size {world} is over {max}, the most a schedule is built for")]
    WorldTooLarge {
        /// The world size asked for.
        world: usize,
        /// The largest world a schedule is built for.
        max: usize,
    },
    /// The calling rank is not a member of the communicator.
    #[error("rank {rank} out of range for world size {world}")]
    RankOutOfRange {
        /// The rank given.
        rank: usize,
        /// The world size.
        world: usize,
    },
    /// The root of a rooted collective is not a member of the communicator.
    #[error("root {root} out of range for world size {world}")]
    RootOutOfRange {
        /// The root given.
        root: usize,
        /// The world size.
        world: usize,
    },
    /// The buffer size in bytes does not fit in `usize`.
    #[error("{count} elements of {dtype} per block times {blocks} blocks overflows usize")]
    SizeOverflow {
        /// Elements per block.
        count: usize,
        /// Their type.
        dtype: DataType,
        /// Number of blocks (the world size for per-rank counts, else 1).
        blocks: usize,
    },
    /// The reduce op is valid for the type but this collective does not support it
    /// ([`ReduceOp::Avg`] in a scan).
    #[error("reduce op {op} is not supported by {collective}")]
    UnsupportedOp {
        /// The collective.
        collective: &'static str,
        /// The op requested.
        op: ReduceOp,
    },
    /// The op is not defined for the data type (for example [`ReduceOp::Avg`] on integers).
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// `complete` named an id this schedule never created.
    #[error("unknown operation {0:?}")]
    UnknownOp(OpId),
    /// `complete` named an action that is not in flight: it was not issued yet.
    #[error("operation {0:?} completed before it was issued")]
    NotIssued(OpId),
    /// `complete` named an action that had already completed.
    #[error("operation {0:?} completed twice")]
    DuplicateCompletion(OpId),
}
