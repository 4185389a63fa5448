//! `CollectiveConfig::max_message_bytes`: every collective, with every algorithm, cuts
//! its messages at the cap (rounded down to whole elements, at least one) and still ends
//! right, in the simulator; the default cap leaves schedules whose messages fit it alone.

#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use common::*;
use nexar_collectives::{
    all_gather, all_reduce, all_to_all, broadcast, gather, reduce, reduce_scatter, scan, scatter,
    Algorithm, CollectiveConfig, RankBuffers, Schedule, ScheduleError, SimNet,
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
                for root in roots(world) {
                    for alg in BROADCAST {
                        let c = capped(alg, cap);
                        check_broadcast_cfg(world, count, DataType::U8, root, &c, SEED);
                        check_broadcast_cfg(world, count, DataType::F64, root, &c, SEED);
                    }
                    for alg in REDUCE {
                        let c = capped(alg, cap);
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
                for (i, placing) in [Placing::Apart, Placing::InPlace].into_iter().enumerate() {
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

/// The default cap (64 MiB) cuts nothing that fits it: every collective sends the same
/// messages as with no cap at all. Buffers of a few KiB stand in for real ones, the cap
/// scaled down with them.
#[test]
fn a_cap_no_message_reaches_changes_no_schedule() {
    let f = DataType::F32;
    for world in worlds() {
        for count in [1, 97, 1000] {
            let (blk, all) = (count * 4, count * 4 * world);
            // A cap at the largest message any algorithm sends here (the whole buffer),
            // against none at all.
            let mut fits = CollectiveConfig::default();
            fits.max_message_bytes = all;
            fits.pipeline_chunk_bytes = 256;
            fits.pipeline_threshold_bytes = 2048;
            let mut none = fits.clone();
            none.max_message_bytes = usize::MAX;
            let (a, b) = (&fits, &none);
            let same = |name: &str, x: (usize, usize), y: (usize, usize)| {
                assert_eq!(x, y, "{name} world {world} count {count}");
            };
            let ar = |c: &CollectiveConfig| {
                traffic(world, blk, 0, |r| {
                    all_reduce(r, world, count, f, ReduceOp::Sum, c)
                })
            };
            same("all_reduce", ar(a), ar(b));
            let bc = |c: &CollectiveConfig| {
                traffic(world, blk, 0, |r| broadcast(r, world, count, f, 0, c))
            };
            same("broadcast", bc(a), bc(b));
            let rd = |c: &CollectiveConfig| {
                traffic(world, blk, 0, |r| {
                    reduce(r, world, count, f, ReduceOp::Sum, 0, c)
                })
            };
            same("reduce", rd(a), rd(b));
            let ag = |c: &CollectiveConfig| {
                traffic(world, all, blk, |r| all_gather(r, world, count, f, c))
            };
            same("all_gather", ag(a), ag(b));
            let rs = |c: &CollectiveConfig| {
                traffic(world, blk, all, |r| {
                    reduce_scatter(r, world, count, f, ReduceOp::Sum, c)
                })
            };
            same("reduce_scatter", rs(a), rs(b));
            let gt = |c: &CollectiveConfig| {
                traffic(world, all, blk, |r| gather(r, world, count, f, 0, c))
            };
            same("gather", gt(a), gt(b));
            let sc = |c: &CollectiveConfig| {
                traffic(world, blk, all, |r| scatter(r, world, count, f, 0, c))
            };
            same("scatter", sc(a), sc(b));
            let aa = |c: &CollectiveConfig| {
                traffic(world, all, all, |r| all_to_all(r, world, count, f, c))
            };
            same("all_to_all", aa(a), aa(b));
            let sn = |c: &CollectiveConfig| {
                traffic(world, blk * 2, 0, |r| {
                    scan(r, world, count, f, ReduceOp::Sum, true, c)
                })
            };
            same("scan", sn(a), sn(b));
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
