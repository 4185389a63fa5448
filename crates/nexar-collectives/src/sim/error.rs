//! [`SimError`]: why a simulated run failed.

use nexar_device::DeviceError;

use crate::{Action, OpId, ScheduleError};

/// Why a simulated run failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SimError {
    /// `run` got a different number of schedules and buffer sets.
    #[error("{schedules} schedules but {buffers} buffer sets")]
    WorldMismatch {
        /// Schedules given.
        schedules: usize,
        /// Buffer sets given.
        buffers: usize,
    },
    /// No work is left but some schedule is not done: a message was lost or never sent.
    #[error("stalled: {detail}")]
    Stalled {
        /// Which ranks wait on what.
        detail: String,
    },
    /// A message arrived for a (sender, step) this rank had already received.
    #[error("rank {dst} got message {step} from rank {src} twice")]
    DuplicateMessage {
        /// Sender.
        src: usize,
        /// Receiver.
        dst: usize,
        /// Message step.
        step: u32,
    },
    /// A schedule sent two messages with the same step to the same peer.
    #[error("rank {src} sent message {step} to rank {dst} twice")]
    DuplicateSend {
        /// Sender.
        src: usize,
        /// Receiver.
        dst: usize,
        /// Message step.
        step: u32,
    },
    /// A schedule posted two receives for the same (sender, step).
    #[error("rank {dst} posted two receives of message {step} from rank {src}")]
    DuplicateRecv {
        /// Sender.
        src: usize,
        /// Receiver.
        dst: usize,
        /// Message step.
        step: u32,
    },
    /// Every schedule finished but messages were never received.
    #[error("{count} message(s) never received: {detail}")]
    Undelivered {
        /// How many.
        count: usize,
        /// Which.
        detail: String,
    },
    /// Every schedule finished but a receive's payload was counted for more sends that
    /// pass it on ([`Schedule::forward_count`](crate::Schedule::forward_count)) than
    /// passed it: a driver would keep it to the end for nothing.
    #[error("rank {rank}: the payload of {recv:?} was to be passed on {uses} more time(s)")]
    Unspent {
        /// The rank.
        rank: usize,
        /// The receive.
        recv: OpId,
        /// Uses counted and not made.
        uses: usize,
    },
    /// A received message's length differs from the receive's range.
    #[error("rank {rank}: message {step} from rank {peer} is {got} bytes, the receive expects {expected}")]
    LengthMismatch {
        /// Receiver.
        rank: usize,
        /// Sender.
        peer: usize,
        /// Message step.
        step: u32,
        /// Bytes the receive range holds.
        expected: usize,
        /// Bytes that arrived.
        got: usize,
    },
    /// An action is malformed: out of bounds, misaligned, writing the input, bad peer.
    #[error("rank {rank}: bad action {action:?}: {reason}")]
    BadAction {
        /// The rank.
        rank: usize,
        /// The action.
        action: Box<Action>,
        /// What is wrong with it.
        reason: String,
    },
    /// Two actions in flight at once on one rank touch the same bytes, one writing.
    #[error("rank {rank}: {first:?} and {second:?} are in flight together and conflict")]
    Race {
        /// The rank.
        rank: usize,
        /// The action issued earlier.
        first: Box<Action>,
        /// The action issued later.
        second: Box<Action>,
    },
    /// A schedule rejected a completion.
    #[error("rank {rank}: {source}")]
    Schedule {
        /// The rank.
        rank: usize,
        /// The schedule's error.
        source: ScheduleError,
    },
    /// A reduction kernel failed.
    #[error("rank {rank}: {source}")]
    Device {
        /// The rank.
        rank: usize,
        /// The kernel's error.
        source: DeviceError,
    },
}
