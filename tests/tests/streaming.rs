//! Collective receives taken piece by piece as QUIC delivers them. In a test binary of
//! its own: it counts the driver's events with a subscriber set for its thread, and
//! tracing caches whether a callsite is wanted per process, so another test hitting the
//! same callsite first, with no subscriber, would hide the events from it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nexar_actors::Cluster;
use nexar_tests::{check_all, on_all_ranks};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::Layer;

const DEADLINE: Duration = Duration::from_secs(300);

/// Counts the collective receives whose payload came as its stream (the driver's
/// "receiving" event with `streamed = true`).
struct CountStreamed(Arc<AtomicUsize>);

impl<S: tracing::Subscriber> Layer<S> for CountStreamed {
    fn enabled(&self, meta: &tracing::Metadata<'_>, _: Context<'_, S>) -> bool {
        meta.target() == "nexar_actors::collective"
    }

    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        struct Streamed(bool);
        impl tracing::field::Visit for Streamed {
            fn record_bool(&mut self, field: &tracing::field::Field, value: bool) {
                if field.name() == "streamed" {
                    self.0 |= value;
                }
            }
            fn record_debug(&mut self, _: &tracing::field::Field, _: &dyn std::fmt::Debug) {}
        }
        let mut visit = Streamed(false);
        event.record(&mut visit);
        if visit.0 {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Large receives are taken piece by piece as QUIC delivers them (handed over as their
/// stream, copied or reduced into place chunk by chunk, elements split across chunks
/// reassembled): every collective with 8-, 2- and 1-byte elements, on a runtime whose one
/// thread carries the counting subscriber.
#[tokio::test(flavor = "current_thread")]
async fn large_receives_are_taken_as_they_arrive() {
    let streamed = Arc::new(AtomicUsize::new(0));
    let subscriber = tracing_subscriber::registry().with(CountStreamed(streamed.clone()));
    let _guard = tracing::subscriber::set_default(subscriber);
    let cluster = Cluster::local(2).await.expect("cluster");
    let res = on_all_ranks(cluster.communicators(), DEADLINE, |comm| async move {
        check_all::<f64>(&comm, 600_001, 65_537).await?;
        check_all::<half::f16>(&comm, 600_001, 131_073).await?;
        check_all::<i8>(&comm, 600_001, 262_147).await
    })
    .await;
    nexar_tests::all_ok("world 2", res);
    cluster.shutdown().await;
    assert!(
        streamed.load(Ordering::Relaxed) > 0,
        "no collective receive came as its stream"
    );
}
