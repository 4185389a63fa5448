//! [`CollectiveConfig`] and [`Algorithm`]: how an algorithm is chosen.

use std::fmt;

/// A collective algorithm, for [`CollectiveConfig::algorithm`] and for reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Algorithm {
    /// Ring: all-reduce (reduce-scatter then all-gather), all-gather, reduce-scatter.
    Ring,
    /// Ring with every block split into chunks of `pipeline_chunk_bytes` (at most
    /// `max_message_bytes`), so chunks of consecutive steps overlap: all-reduce,
    /// all-gather, reduce-scatter.
    RingPipelined,
    /// Recursive doubling: all-reduce (whole vector each round; small messages),
    /// all-gather (powers of two only), scan.
    RecursiveDoubling,
    /// Recursive halving then doubling (Rabenseifner): all-reduce.
    RecursiveHalvingDoubling,
    /// Recursive halving: reduce-scatter (powers of two only).
    RecursiveHalving,
    /// Bruck's algorithm: all-gather and all-to-all (any world size).
    Bruck,
    /// Binomial tree: broadcast, reduce, gather and scatter (small buffers).
    Binomial,
    /// Pipelined chain: broadcast.
    Chain,
    /// Binomial scatter then all-gather (recursive doubling on 8, 16, ... ranks with
    /// blocks of `broadcast_rd_block_bytes` and more, else a ring): broadcast.
    ScatterAllGather,
    /// Ring reduce-scatter then gather at the root: reduce.
    ReduceScatterGather,
    /// Pairwise exchange: all-to-all.
    Pairwise,
    /// Dissemination: barrier.
    Dissemination,
    /// Every block straight between the root and its rank: gather, scatter.
    Linear,
}

impl Algorithm {
    /// Every algorithm.
    pub const ALL: [Algorithm; 13] = [
        Algorithm::Ring,
        Algorithm::RingPipelined,
        Algorithm::RecursiveDoubling,
        Algorithm::RecursiveHalvingDoubling,
        Algorithm::RecursiveHalving,
        Algorithm::Bruck,
        Algorithm::Binomial,
        Algorithm::Chain,
        Algorithm::ScatterAllGather,
        Algorithm::ReduceScatterGather,
        Algorithm::Pairwise,
        Algorithm::Dissemination,
        Algorithm::Linear,
    ];

    /// The short name, as returned by [`Schedule::name`](crate::Schedule::name).
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::Ring => "ring",
            Algorithm::RingPipelined => "ring_pipelined",
            Algorithm::RecursiveDoubling => "rd",
            Algorithm::RecursiveHalvingDoubling => "rhd",
            Algorithm::RecursiveHalving => "rh",
            Algorithm::Bruck => "bruck",
            Algorithm::Binomial => "binomial",
            Algorithm::Chain => "chain",
            Algorithm::ScatterAllGather => "scatter_allgather",
            Algorithm::ReduceScatterGather => "rsg",
            Algorithm::Pairwise => "pairwise",
            Algorithm::Dissemination => "dissemination",
            Algorithm::Linear => "linear",
        }
    }

    /// Parses a [`name`](Self::name).
    pub fn from_name(s: &str) -> Option<Algorithm> {
        Algorithm::ALL.into_iter().find(|a| a.name() == s)
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Tuning for algorithm selection. Sizes are the bytes of the whole buffer a collective
/// works on (for all-gather, gather, reduce-scatter, scatter and all-to-all, the full
/// `count_per_rank * world` buffer).
///
/// | collective | size < `tiny_bytes` | < `small_bytes` | < `pipeline_threshold_bytes` | larger |
/// |---|---|---|---|---|
/// | all_reduce | rd | rhd | rhd (2^k ranks, k > 1) / ring | rhd (2^k ranks, k > 1) / ring_pipelined |
/// | broadcast | binomial | binomial | scatter_allgather (chain with 2 ranks) | chain |
/// | reduce | binomial | binomial | binomial | rsg (binomial with 2 ranks) |
/// | all_gather | rd (2^k ranks) / bruck | same | rd (2^k ranks, k > 1) / ring | rd (2^k ranks, k > 1) / ring_pipelined (ring with 2 ranks) |
/// | reduce_scatter | rh (2^k ranks) / ring | same | rh (2^k ranks, k > 1) / ring | rh (2^k ranks, k > 1) / ring_pipelined (ring with 2 ranks) |
/// | gather, scatter | binomial | binomial | linear | linear |
///
/// all_to_all uses bruck when each per-rank block is under `bruck_block_bytes` and the
/// world has more than two ranks, else pairwise exchange; barrier uses dissemination, scan
/// recursive doubling.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct CollectiveConfig {
    /// Below this, latency-bound algorithms that move whole vectors each round
    /// (recursive doubling). Default 16 KiB.
    pub tiny_bytes: usize,
    /// Below this, logarithmic-round algorithms (rhd, binomial, bruck); at or above, ring
    /// (on 4, 8, 16, ... ranks all_reduce takes rhd, all_gather rd and reduce_scatter rh
    /// at every size). Default 512 KiB.
    pub small_bytes: usize,
    /// At or above this, pipelined variants (chunked ring, but rhd for all_reduce, rd for
    /// all_gather and rh for reduce_scatter on 4, 8, 16, ... ranks, as below it, and the
    /// whole-block ring for all_gather and reduce_scatter on 2 ranks, where chunks have
    /// nothing to overlap; chain broadcast; reduce-scatter + gather for reduce). Default
    /// 8 MiB.
    pub pipeline_threshold_bytes: usize,
    /// Chunk size of pipelined variants and of recursive-halving reduce-scatter's
    /// messages, rounded down to whole elements (at least one), and at most
    /// `max_message_bytes`. Every rank must use the same, as with `max_message_bytes`:
    /// ranks that cut differently number their messages differently. Default 1 MiB.
    pub pipeline_chunk_bytes: usize,
    /// all_to_all: per-rank blocks below this use Bruck's algorithm (`log2(world)`
    /// messages of about half the buffer each) instead of pairwise exchange. Default 256.
    pub bruck_block_bytes: usize,
    /// The most sends and local actions one rank keeps in flight per collective; 0 means
    /// unlimited. Receives are not counted. Default 16.
    pub window: usize,
    /// Linear gathers into one root (`gather` from `small_bytes`, the gather phase of
    /// reduce's `rsg`) let `max(2, incast_bytes / block)` senders stream at once; each
    /// further sender waits for an empty go message from the root, sent when an earlier
    /// sender's block is in. Unpaced, every sender has a send window in flight toward the
    /// root at once, and what overflows the root's UDP receive buffer is lost: 8 ranks,
    /// 64 MiB, about 25 datagrams per call (bench/HISTORY.md, session 13). Keep it under
    /// that buffer. Default 4 MiB.
    pub incast_bytes: usize,
    /// Broadcast's scatter-allgather on 8, 16, ... ranks gathers the scattered blocks by
    /// recursive doubling when each rank's block (the buffer over the world) is at least
    /// this, by a ring when smaller. 8 processes: 256 KiB blocks (2 MiB) took 12% less CPU
    /// by recursive doubling, 128 KiB blocks (1 MiB) 6% more (BENCHMARKS.md, session 33).
    /// It applies wherever scatter-allgather runs: forced past the pipeline threshold as
    /// well, where recursive doubling sends each group whole (cut only at
    /// `max_message_bytes`) while the ring pipelines its blocks. Every rank must use the
    /// same. Default 256 KiB.
    pub broadcast_rd_block_bytes: usize,
    /// Forces an algorithm for every collective that implements it (for this world size);
    /// other collectives keep the automatic choice. [`Schedule::name`](crate::Schedule::name)
    /// reports what was chosen. Default `None`.
    pub algorithm: Option<Algorithm>,
    /// The most bytes one message of a collective carries, rounded down to whole elements
    /// (at least one). A larger block or buffer travels as several messages of at most
    /// this size, whatever the algorithm, so no collective needs a frame larger than it.
    /// Pipelined variants, and recursive-halving reduce-scatter, cut their chunks at
    /// `min(pipeline_chunk_bytes, this)`. Every
    /// rank must use the same (ranks that cut alike number their messages alike): ranks
    /// that differ fail their collectives (with a length mismatch, or at the deadline). A
    /// node refuses to start with a value over the largest message it may send
    /// (`TransportConfig::max_frame_bytes`, less a relay's envelope on sparse topologies)
    /// or under 4 KiB (`nexar_actors::MIN_MESSAGE_BYTES`). Default 64 MiB: larger
    /// messages gain nothing, the pipelined variants already sending 1 MiB chunks (one
    /// 256 MiB reduce message against four of 64 MiB: 262 against 273 ms, with more CPU;
    /// bench/HISTORY.md, session 31). Only a block that would need more than `2^30 / phases`
    /// pieces (phases: 2 x world for the ring all-reduce) gets larger ones, to keep message
    /// numbers in range.
    pub max_message_bytes: usize,
}

impl Default for CollectiveConfig {
    fn default() -> Self {
        Self {
            tiny_bytes: 16 << 10,
            small_bytes: 512 << 10,
            pipeline_threshold_bytes: 8 << 20,
            pipeline_chunk_bytes: 1 << 20,
            bruck_block_bytes: 256,
            window: 16,
            incast_bytes: 4 << 20,
            broadcast_rd_block_bytes: 256 << 10,
            algorithm: None,
            max_message_bytes: 64 << 20,
        }
    }
}

impl CollectiveConfig {
    /// The same configuration with `algorithm` forced.
    pub fn with_algorithm(mut self, algorithm: Algorithm) -> Self {
        self.algorithm = Some(algorithm);
        self
    }

    /// Returns the forced algorithm if it is one of `supported`.
    pub(crate) fn forced(&self, supported: &[Algorithm]) -> Option<Algorithm> {
        self.algorithm.filter(|a| supported.contains(a))
    }
}
