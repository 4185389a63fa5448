//! A deterministic toy experiment: data-parallel gradient descent on least squares with
//! the gradient all-reduce done through the codecs, in-process. Run with `--nocapture`
//! to see the table.

#![allow(clippy::unwrap_used)]

use nexar_device::{finalize_slice, DataType, ReduceOp};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;

const WORKERS: usize = 4;
const DIM: usize = 1000;
const ROWS: usize = 500;
const STEPS: usize = 200;

/// Worker j holds `ROWS` rows of A and b, with its own planted solution, so the workers'
/// gradients disagree even at the optimum (as data-parallel shards do).
struct Problem {
    a: Vec<Vec<f32>>,
    b: Vec<Vec<f32>>,
}

fn dot(x: &[f32], y: &[f32]) -> f32 {
    x.iter().zip(y).map(|(a, b)| a * b).sum()
}

impl Problem {
    fn new(seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let w_true: Vec<f32> = (0..DIM).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let scale = 3.0f32.sqrt(); // unit variance entries
        let mut a = Vec::new();
        let mut b = Vec::new();
        for _ in 0..WORKERS {
            let shift: Vec<f32> = w_true
                .iter()
                .map(|w| w + rng.gen_range(-0.3..0.3))
                .collect();
            let aj: Vec<f32> = (0..ROWS * DIM)
                .map(|_| scale * rng.gen_range(-1.0f32..1.0))
                .collect();
            let bj = aj
                .chunks_exact(DIM)
                .map(|row| dot(row, &shift) + rng.gen_range(-0.1..0.1))
                .collect();
            a.push(aj);
            b.push(bj);
        }
        Self { a, b }
    }

    /// Worker j's gradient of its mean squared residual / 2.
    fn gradient(&self, j: usize, w: &[f32]) -> Vec<f32> {
        let mut g = vec![0.0f32; DIM];
        for (row, &bi) in self.a[j].chunks_exact(DIM).zip(&self.b[j]) {
            let r = (dot(row, w) - bi) / ROWS as f32;
            g.iter_mut().zip(row).for_each(|(g, a)| *g += r * a);
        }
        g
    }

    /// Mean over all rows of squared residual / 2.
    fn loss(&self, w: &[f32]) -> f64 {
        let mut total = 0.0f64;
        for (aj, bj) in self.a.iter().zip(&self.b) {
            for (row, &bi) in aj.chunks_exact(DIM).zip(bj) {
                total += f64::from(dot(row, w) - bi).powi(2);
            }
        }
        total / (2 * WORKERS * ROWS) as f64
    }

    fn exact_gradient(&self, w: &[f32]) -> Vec<f32> {
        let mut avg = vec![0.0f32; DIM];
        for j in 0..WORKERS {
            avg.iter_mut()
                .zip(self.gradient(j, w))
                .for_each(|(a, g)| *a += g / WORKERS as f32);
        }
        avg
    }

    /// Largest eigenvalue of the Hessian, by power iteration.
    fn max_curvature(&self) -> f64 {
        let zero = vec![0.0f32; DIM];
        let bias = self.exact_gradient(&zero); // gradient at 0 is -A^T b / N
        let mut v = vec![1.0f32 / (DIM as f32).sqrt(); DIM];
        let mut lambda = 0.0;
        for _ in 0..30 {
            // H v = grad(v) - grad(0)
            let hv: Vec<f32> = self
                .exact_gradient(&v)
                .iter()
                .zip(&bias)
                .map(|(g, b)| g - b)
                .collect();
            let norm = dot(&hv, &hv).sqrt();
            lambda = f64::from(norm);
            v = hv.iter().map(|x| x / norm).collect();
        }
        lambda
    }
}

#[derive(Clone, Copy)]
enum Variant {
    Exact,
    Compressed { codec: Codec, feedback: bool },
}

struct Run {
    loss: Vec<f64>,
    bytes_per_rank: usize,
}

fn train(p: &Problem, variant: Variant, lr: f32) -> Run {
    let mut w = vec![0.0f32; DIM];
    let mut residuals: Vec<Residual<f32>> = (0..WORKERS).map(|_| Residual::new(DIM)).collect();
    let mut loss = vec![p.loss(&w)];
    let mut bytes_per_rank = DIM * 4;
    for step in 0..STEPS {
        let avg = match variant {
            Variant::Exact => p.exact_gradient(&w),
            Variant::Compressed { codec, feedback } => {
                // Each worker compresses and encodes; every rank would receive all blocks
                // and accumulate them in rank order.
                let blocks: Vec<Vec<u8>> = residuals
                    .iter_mut()
                    .enumerate()
                    .map(|(j, r)| {
                        let g = p.gradient(j, &w);
                        let s = if feedback {
                            compress_with_feedback(&codec, step as u64, &g, r)
                        } else {
                            compress(&codec, step as u64, &g)
                        };
                        encode(&s.unwrap())
                    })
                    .collect();
                bytes_per_rank = blocks[0].len();
                assert!(blocks
                    .iter()
                    .all(|b| b.len() == codec.wire_bytes(DIM, DataType::F32)));
                let mut avg = vec![0.0f32; DIM];
                for b in &blocks {
                    accumulate(&mut avg, &decode(b, DIM).unwrap()).unwrap();
                }
                finalize_slice(ReduceOp::Avg, &mut avg, WORKERS).unwrap();
                avg
            }
        };
        w.iter_mut().zip(&avg).for_each(|(w, g)| *w -= lr * g);
        if (step + 1) % 50 == 0 {
            loss.push(p.loss(&w));
        }
    }
    Run {
        loss,
        bytes_per_rank,
    }
}

fn norm(v: &[f32]) -> f64 {
    v.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt()
}

/// ||compressed average - exact average|| / ||exact average|| at `w`, without feedback.
fn relative_error(p: &Problem, codec: Codec, w: &[f32]) -> f64 {
    let exact = p.exact_gradient(w);
    let mut avg = vec![0.0f32; DIM];
    for j in 0..WORKERS {
        let s = compress(&codec, 0, &p.gradient(j, w)).unwrap();
        accumulate(&mut avg, &s).unwrap();
    }
    finalize_slice(ReduceOp::Avg, &mut avg, WORKERS).unwrap();
    let diff: Vec<f32> = avg.iter().zip(&exact).map(|(a, e)| a - e).collect();
    norm(&diff) / norm(&exact)
}

fn fmt_loss(l: f64) -> String {
    if l.is_finite() && l < 1e5 {
        format!("{l:.4}")
    } else {
        format!("{l:.2e}")
    }
}

fn variants() -> [(&'static str, Variant); 6] {
    let top = |r| Codec::top_k(r).unwrap();
    let rand = |r| Codec::random_k(r, 77).unwrap();
    let ef = |codec| Variant::Compressed {
        codec,
        feedback: true,
    };
    let no_ef = |codec| Variant::Compressed {
        codec,
        feedback: false,
    };
    [
        ("exact (dense)", Variant::Exact),
        ("top-k 10% + EF", ef(top(0.1))),
        ("top-k 1% + EF", ef(top(0.01))),
        ("random-k 10% + EF", ef(rand(0.1))),
        ("top-k 10%, no EF", no_ef(top(0.1))),
        ("random-k 10% (n/k), no EF", no_ef(rand(0.1))),
    ]
}

/// `scale / L`, L the largest curvature; 1/L is the classic step for exact descent.
fn learning_rate(p: &Problem, scale: f64) -> f32 {
    (scale / (1.05 * p.max_curvature())) as f32
}

/// Bytes each rank sends per step in a ring: a dense all-reduce moves 2 (w-1)/w of the
/// buffer; the compressed one all-gathers w-1 encoded blocks.
fn ring_bytes(run_bytes: usize, exact: bool) -> usize {
    if exact {
        2 * (WORKERS - 1) * run_bytes / WORKERS
    } else {
        (WORKERS - 1) * run_bytes
    }
}

#[test]
fn least_squares_with_compressed_gradients() {
    let p = Problem::new(2024);
    // A quarter of the classic step: error feedback delays updates by about n/k steps,
    // and at 1/L the aggressive codecs diverge (see `learning_rate_sweep`).
    let lr = learning_rate(&p, 0.25);
    println!(
        "\nleast squares: {WORKERS} workers x {ROWS} rows, {DIM} dims, f32, lr 0.25/L = {lr:.4}"
    );
    println!(
        "{:<27} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7} {:>7}",
        "variant", "loss@0", "@50", "@100", "@150", "@200", "block", "ring"
    );
    let mut finals = Vec::new();
    for (name, v) in variants() {
        let run = train(&p, v, lr);
        let cells: Vec<String> = run
            .loss
            .iter()
            .map(|&l| format!("{:>9}", fmt_loss(l)))
            .collect();
        let exact = matches!(v, Variant::Exact);
        println!(
            "{name:<27} {} {:>7} {:>7}",
            cells.join(" "),
            run.bytes_per_rank,
            ring_bytes(run.bytes_per_rank, exact)
        );
        finals.push(*run.loss.last().unwrap());
    }
    let [exact, top10_ef, top1_ef, rand10_ef, top10_no_ef, rand10_unbiased] = finals[..] else {
        unreachable!()
    };

    println!("\nrelative error of one averaged gradient at w = 0, no EF");
    println!(
        "{:>6} {:>8} {:>15} {:>7}",
        "ratio", "top-k", "random-k (n/k)", "block"
    );
    let zero = vec![0.0f32; DIM];
    let mut top_errors = Vec::new();
    for ratio in [0.01, 0.05, 0.1, 0.25, 0.5, 1.0] {
        let top = Codec::top_k(ratio).unwrap();
        let (t, r) = (
            relative_error(&p, top, &zero),
            relative_error(&p, Codec::random_k(ratio, 77).unwrap(), &zero),
        );
        println!(
            "{ratio:>6} {t:>8.4} {r:>15.4} {:>7}",
            top.wire_bytes(DIM, DataType::F32)
        );
        top_errors.push(t);
    }

    // Exact descent converges; error feedback keeps compressed descent close to it, and
    // beats dropping what was not sent even at a tenth of the bytes.
    let start = p.loss(&zero);
    assert!(exact < 0.05 * start, "exact {exact} from {start}");
    assert!(
        top10_ef < 1.05 * exact,
        "top-k 10% EF {top10_ef} vs exact {exact}"
    );
    assert!(
        rand10_ef < 1.5 * exact,
        "random-k 10% EF {rand10_ef} vs exact {exact}"
    );
    assert!(
        top1_ef < 4.0 * exact,
        "top-k 1% EF {top1_ef} vs exact {exact}"
    );
    assert!(
        2.0 * top10_ef < top10_no_ef,
        "EF {top10_ef} vs no EF {top10_no_ef}"
    );
    assert!(
        top1_ef < top10_no_ef,
        "1% EF {top1_ef} vs 10% no EF {top10_no_ef}"
    );
    assert!(rand10_unbiased.is_finite());
    // Keeping more never hurts top-k; keeping everything is exact.
    assert!(top_errors.windows(2).all(|w| w[1] <= w[0]));
    assert!(top_errors.last().unwrap() < &1e-6);
}

/// Final loss for several step sizes; slow, so run on demand:
/// `cargo test -p nexar-collectives --lib learning_rate_sweep -- --ignored --nocapture`.
#[test]
#[ignore]
fn learning_rate_sweep() {
    let p = Problem::new(2024);
    let scales = [1.0, 0.5, 0.25, 0.1];
    println!("\nloss after {STEPS} steps, by learning rate");
    let head: Vec<String> = scales
        .iter()
        .map(|s| format!("{:>10}", format!("{s}/L")))
        .collect();
    println!("{:<27} {}", "variant", head.join(" "));
    for (name, v) in variants() {
        let cells: Vec<String> = scales
            .iter()
            .map(|&s| {
                format!(
                    "{:>10}",
                    fmt_loss(*train(&p, v, learning_rate(&p, s)).loss.last().unwrap())
                )
            })
            .collect();
        println!("{name:<27} {}", cells.join(" "));
    }
}
