//! The algorithm a running cluster picks for a collective, as the driver's `collective`
//! span names it, not only the one the schedule constructors give for the same sizes
//! (which the tests in collectives.rs check, with the results). In a test binary of its
//! own: a subscriber set for the thread sees the spans, and tracing caches per process
//! whether a callsite is wanted, so another test reaching the same callsite first with no
//! subscriber would hide them from it.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use nexar_actors::{Cluster, Communicator};
use nexar_device::ReduceOp;
use nexar_tests::on_all_ranks;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::Layer;

const DEADLINE: Duration = Duration::from_secs(120);

/// The `algorithm` of every `collective` span opened since it was last emptied.
#[derive(Clone, Default)]
struct Picked(Arc<Mutex<Vec<String>>>);

impl Picked {
    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.0.lock().expect("lock"))
    }
}

impl<S: tracing::Subscriber> Layer<S> for Picked {
    fn enabled(&self, meta: &tracing::Metadata<'_>, _: Context<'_, S>) -> bool {
        meta.target() == "nexar_actors::collective" && meta.name() == "collective"
    }

    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        _: &tracing::span::Id,
        _: Context<'_, S>,
    ) {
        struct Algorithm(Option<String>);
        impl tracing::field::Visit for Algorithm {
            fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
                if field.name() == "algorithm" {
                    self.0 = Some(value.to_string());
                }
            }
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "algorithm" {
                    self.0 = Some(format!("{value:?}"));
                }
            }
        }
        let mut visit = Algorithm(None);
        attrs.record(&mut visit);
        if let Some(name) = visit.0 {
            self.0.lock().expect("lock").push(name);
        }
    }
}

/// Runs `call` on every rank of `cluster` and returns the algorithms the ranks' drivers
/// ran it with (one per rank).
async fn picked_for<F, Fut>(cluster: &Cluster, picked: &Picked, call: F) -> Vec<String>
where
    F: Fn(Communicator) -> Fut,
    Fut: std::future::Future<Output = Result<(), nexar_actors::NexarError>> + Send + 'static,
{
    picked.take();
    let res = on_all_ranks(cluster.communicators(), DEADLINE, call).await;
    nexar_tests::all_ok("the call", res);
    picked.take()
}

/// A cluster of `world` ranks on this thread, with `picked` seeing its spans.
async fn traced(world: usize) -> (Cluster, Picked, tracing::subscriber::DefaultGuard) {
    let picked = Picked::default();
    let subscriber = tracing_subscriber::registry().with(picked.clone());
    let guard = tracing::subscriber::set_default(subscriber);
    let cluster = Cluster::local(world).await.expect("cluster");
    (cluster, picked, guard)
}

/// On 3 ranks, an all-reduce of 12 MB takes the pipelined ring and an all-gather of 1 MB
/// blocks a ring (on 4, 8, 16, ... ranks other algorithms take every size).
#[tokio::test(flavor = "current_thread")]
async fn three_ranks_run_large_buffers_on_rings() {
    let (cluster, picked, _guard) = traced(3).await;
    let reduce = picked_for(&cluster, &picked, |comm| async move {
        let mut v = vec![1f32; 3_000_001];
        comm.all_reduce(&mut v, ReduceOp::Sum).await
    })
    .await;
    assert_eq!(reduce, vec!["ring_pipelined"; 3]);
    let gather = picked_for(&cluster, &picked, |comm| async move {
        let mut out = vec![0f32; 3 * 262_147];
        comm.all_gather(&vec![1f32; 262_147], &mut out).await
    })
    .await;
    assert_eq!(gather.len(), 3, "{gather:?}");
    assert!(gather.iter().all(|a| a.starts_with("ring")), "{gather:?}");
    cluster.shutdown().await;
}

/// On 4 ranks, an all-gather takes recursive doubling, a reduce-scatter recursive
/// halving and an all-reduce recursive halving-doubling, past the pipeline threshold.
#[tokio::test(flavor = "current_thread")]
async fn four_ranks_run_large_buffers_by_halving_and_doubling() {
    let (cluster, picked, _guard) = traced(4).await;
    let block = 524_291;
    let gather = picked_for(&cluster, &picked, move |comm| async move {
        let mut out = vec![0f32; 4 * block];
        comm.all_gather(&vec![1f32; block], &mut out).await
    })
    .await;
    assert_eq!(gather, vec!["rd"; 4]);
    let scatter = picked_for(&cluster, &picked, move |comm| async move {
        let mut out = vec![0f32; block];
        comm.reduce_scatter(&vec![1f32; 4 * block], &mut out, ReduceOp::Sum)
            .await
    })
    .await;
    assert_eq!(scatter, vec!["rh"; 4]);
    let reduce = picked_for(&cluster, &picked, |comm| async move {
        let mut v = vec![1f32; 3_000_001];
        comm.all_reduce(&mut v, ReduceOp::Sum).await
    })
    .await;
    assert_eq!(reduce, vec!["rhd"; 4]);
    cluster.shutdown().await;
}

/// On 8 ranks, a broadcast of 2 MB scatters, then all-gathers.
#[tokio::test(flavor = "current_thread")]
async fn eight_ranks_broadcast_two_megabytes_by_scatter_and_all_gather() {
    let (cluster, picked, _guard) = traced(8).await;
    for root in [0, 3] {
        let cast = picked_for(&cluster, &picked, move |comm| async move {
            let mut v = vec![root as i32; 524_293];
            comm.broadcast(&mut v, root).await
        })
        .await;
        assert_eq!(cast, vec!["scatter_allgather"; 8], "root {root}");
    }
    cluster.shutdown().await;
}
