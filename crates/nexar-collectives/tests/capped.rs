//! `CollectiveConfig::max_message_bytes`: every collective, with every algorithm, cuts
//! its messages at the cap (rounded down to whole elements, at least one) and still ends
//! right, in the simulator; the default cap leaves schedules whose messages fit it alone.

#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use common::*;
use nexar_collectives::{
    all_gather, all_reduce, all_to_all, broadcast, gather, reduce, reduce_scatter, scan, scatter,
    Action, Algorithm, CollectiveConfig, RankBuffers, Schedule, ScheduleError, SimNet,
};
use nexar_device::{DataType, ReduceOp};

const SEED: u64 = 7;
/// One element of every type, a few elements, and a size that cuts blocks unevenly.
const CAPS: [usize; 3] = [1, 12, 40];
const LARGE: usize = 300;

fn worlds() -> std::ops::RangeInclusive<usize> {
    1..=9
}

#[test]
fn all_reduce_cuts_its_messages_at_the_cap() {
    for world in worlds() {
        for count in counts(world, LARGE) {
            for cap in CAPS {
                for alg in ALL_REDUCE {
                    for (dtype, op) in [
                        (DataType::F32, ReduceOp::Sum),
                        (DataType::F64, ReduceOp::Max),
                    ] {
                        check_all_reduce_cfg(world, count, dtype, op, &capped(alg, cap), SEED);
                    }
                }
            }
        }
    }
}

#[test]
fn broadcast_and_reduce_cut_their_messages_at_the_cap() {
    for world in worlds() {
        for count in counts(world, LARGE) {
            for cap in CAPS {
                // With the threshold at 0, scatter-allgather and rsg pipeline too.
                for (root, threshold) in roots(world).into_iter().zip([usize::MAX, 0, 0]) {
                    for alg in BROADCAST {
                        let mut c = capped(alg, cap);
                        c.pipeline_threshold_bytes = threshold;
                        check_broadcast_cfg(world, count, DataType::U8, root, &c, SEED);
                        check_broadcast_cfg(world, count, DataType::F64, root, &c, SEED);
                    }
                    for alg in REDUCE {
                        let mut c = capped(alg, cap);
                        c.pipeline_threshold_bytes = threshold;
                        check_reduce_cfg(
                            world,
                            count,
                            DataType::I32,
                            ReduceOp::Sum,
                            root,
                            &c,
                            SEED,
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn all_gather_and_reduce_scatter_cut_their_messages_at_the_cap() {
    for world in worlds() {
        for count in counts(world, LARGE / 4) {
            for cap in CAPS {
                for (i, placing) in Placing::ALL.into_iter().enumerate() {
                    for alg in all_gather_algs(world) {
                        let dtype = if i == 0 { DataType::U8 } else { DataType::F32 };
                        check_all_gather_cfg(world, count, dtype, &capped(alg, cap), SEED, placing);
                    }
                    for alg in reduce_scatter_algs(world) {
                        let c = capped(alg, cap);
                        check_reduce_scatter_cfg(
                            world,
                            count,
                            DataType::F32,
                            ReduceOp::Sum,
                            &c,
                            SEED,
                            placing,
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn gather_scatter_all_to_all_and_scan_cut_their_messages_at_the_cap() {
    for world in worlds() {
        for count in counts(world, LARGE / 4) {
            for cap in CAPS {
                for root in roots(world) {
                    for alg in ROOTED {
                        let c = capped(alg, cap);
                        check_gather_cfg(world, count, DataType::F32, root, &c, SEED);
                        check_scatter_cfg(world, count, DataType::U8, root, &c, SEED);
                    }
                }
                for alg in ALL_TO_ALL {
                    let c = capped(Some(alg), cap);
                    check_all_to_all_cfg(world, count, DataType::F32, &c, SEED);
                }
                for exclusive in [false, true] {
                    let c = capped(None, cap);
                    check_scan_cfg(
                        world,
                        count,
                        DataType::I64,
                        ReduceOp::Sum,
                        exclusive,
                        &c,
                        SEED,
                    );
                }
            }
        }
    }
}

/// Messages and payload bytes of one collective's run over `world` ranks of zeroed
/// buffers (`data` and `input` bytes each).
fn traffic(
    world: usize,
    data: usize,
    input: usize,
    make: impl Fn(usize) -> Result<Box<dyn Schedule>, ScheduleError>,
) -> (usize, usize) {
    let schedules = (0..world).map(|r| make(r).unwrap()).collect();
    let bufs = (0..world)
        .map(|_| RankBuffers::new(vec![0; data], vec![0; input]))
        .collect();
    let out = SimNet::new(SEED)
        .run(DataType::F32, ReduceOp::Sum, schedules, bufs)
        .unwrap();
    (out.stats.messages, out.stats.bytes)
}

/// One message end: (rank, a send, peer, step, bytes).
type End = (usize, bool, usize, u32, usize);

/// Makes rank `r`'s schedule of a collective under a config.
type Make<'a> = dyn Fn(usize, &CollectiveConfig) -> Result<Box<dyn Schedule>, ScheduleError> + 'a;

/// Every send and receive of every rank's schedule, sorted: each schedule is drained by
/// completing every action as soon as it is let out.
fn plan(
    world: usize,
    make: impl Fn(usize) -> Result<Box<dyn Schedule>, ScheduleError>,
) -> Vec<End> {
    let mut out = Vec::new();
    for r in 0..world {
        let mut s = make(r).unwrap();
        let mut ready = Vec::new();
        for _ in 0..1_000_000 {
            if s.is_done() {
                break;
            }
            ready.clear();
            s.poll(&mut ready);
            assert!(!ready.is_empty(), "rank {r}'s {} stalls", s.name());
            for a in &ready {
                match a {
                    Action::Send {
                        peer, step, src, ..
                    } => out.push((r, true, *peer, *step, src.len())),
                    Action::Recv {
                        peer, step, dst, ..
                    } => out.push((r, false, *peer, *step, dst.len())),
                    _ => {}
                }
                s.complete(a.id()).unwrap();
            }
        }
        assert!(s.is_done(), "rank {r}'s {} does not finish", s.name());
    }
    out.sort_unstable();
    out
}

/// A cap at or over a collective's whole buffer cuts nothing: with every algorithm, every
/// rank sends and receives the same messages, under the same step numbers, as with no cap
/// at all (so the default cap, 64 MiB, leaves every collective of up to 64 MiB as it
/// was). Buffers of a few KiB stand in for real ones, the cap scaled down with them.
#[test]
fn a_cap_no_message_reaches_changes_no_schedule() {
    let f = DataType::F32;
    let sum = ReduceOp::Sum;
    for world in worlds() {
        for count in [1, 97, 1000] {
            let all = count * 4 * world;
            let with = |alg: Option<Algorithm>, cap: usize| {
                let mut c = CollectiveConfig::default();
                c.max_message_bytes = cap;
                c.pipeline_chunk_bytes = 256;
                c.pipeline_threshold_bytes = 2048;
                c.algorithm = alg;
                c
            };
            let same = |name: &str, alg: Option<Algorithm>, make: &Make| {
                let (fits, none) = (with(alg, all), with(alg, usize::MAX));
                let capped = plan(world, |r| make(r, &fits));
                let uncapped = plan(world, |r| make(r, &none));
                assert!(
                    capped == uncapped,
                    "{name} {alg:?} world {world} count {count}: the cap changed the messages"
                );
            };
            for alg in ALL_REDUCE {
                same("all_reduce", alg, &|r, c| {
                    all_reduce(r, world, count, f, sum, c)
                });
            }
            for alg in BROADCAST.into_iter().chain([None]) {
                same("broadcast", alg, &|r, c| {
                    broadcast(r, world, count, f, 0, c)
                });
            }
            for alg in REDUCE.into_iter().chain([None]) {
                same("reduce", alg, &|r, c| {
                    reduce(r, world, count, f, sum, 1 % world, c)
                });
            }
            for alg in all_gather_algs(world) {
                same("all_gather", alg, &|r, c| all_gather(r, world, count, f, c));
            }
            for alg in reduce_scatter_algs(world) {
                same("reduce_scatter", alg, &|r, c| {
                    reduce_scatter(r, world, count, f, sum, c)
                });
            }
            for alg in ROOTED {
                same("gather", alg, &|r, c| {
                    gather(r, world, count, f, world - 1, c)
                });
                same("scatter", alg, &|r, c| scatter(r, world, count, f, 0, c));
            }
            for alg in ALL_TO_ALL {
                same("all_to_all", Some(alg), &|r, c| {
                    all_to_all(r, world, count, f, c)
                });
            }
            for exclusive in [false, true] {
                same("scan", None, &|r, c| {
                    scan(r, world, count, f, sum, exclusive, c)
                });
            }
        }
    }
}

/// A binomial broadcast sends the whole buffer down every edge of its tree; under a cap
/// every such message becomes `ceil(bytes / cap)` messages, the last one shorter.
#[test]
fn a_capped_message_becomes_as_many_messages_as_the_cap_needs() {
    for world in 2..=9 {
        for (count, cap) in [(97, 40), (100, 40), (10, 4), (10, 3)] {
            let mut c = CollectiveConfig::default().with_algorithm(Algorithm::Binomial);
            let bytes = count * 4;
            let whole = traffic(world, bytes, 0, |r| {
                broadcast(r, world, count, DataType::F32, 0, &c)
            });
            assert_eq!(whole, (world - 1, (world - 1) * bytes));
            c.max_message_bytes = cap;
            let cut = traffic(world, bytes, 0, |r| {
                broadcast(r, world, count, DataType::F32, 0, &c)
            });
            // Whole elements: a cap of 3 bytes carries one f32 per message.
            let per = bytes.div_ceil((cap / 4).max(1) * 4);
            assert_eq!(
                cut,
                ((world - 1) * per, (world - 1) * bytes),
                "world {world} count {count} cap {cap}"
            );
        }
    }
}
