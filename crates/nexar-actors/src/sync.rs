//! A blocking facade for callers without an async runtime.

use std::sync::Arc;

use nexar_device::{Element, ReduceOp};

use crate::{Cluster, Communicator, NexarError, NodeConfig, Result};

/// An in-process cluster driven from synchronous code: it owns a tokio runtime.
#[derive(Debug)]
pub struct SyncCluster {
    runtime: Arc<OwnedRuntime>,
    cluster: Option<Cluster>,
}

/// The facade's runtime, shared by the cluster and its communicators. Whichever of them
/// goes last drops it, possibly inside some other async runtime's task, where tokio
/// refuses (with a panic) to wait for a runtime's threads: there it is shut down in the
/// background instead.
#[derive(Debug)]
struct OwnedRuntime(Option<tokio::runtime::Runtime>);

impl std::ops::Deref for OwnedRuntime {
    type Target = tokio::runtime::Runtime;

    fn deref(&self) -> &tokio::runtime::Runtime {
        // Present until drop, the only place that takes it.
        self.0
            .as_ref()
            .unwrap_or_else(|| unreachable!("runtime taken before drop"))
    }
}

impl Drop for OwnedRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            if tokio::runtime::Handle::try_current().is_ok() {
                rt.shutdown_background();
            }
        }
    }
}

impl SyncCluster {
    /// Builds a `world`-rank in-process cluster with default settings. Must not be called
    /// from inside an async runtime.
    pub fn local(world: usize) -> Result<SyncCluster> {
        SyncCluster::local_with(world, NodeConfig::default())
    }

    /// Builds a `world`-rank in-process cluster with `config`.
    pub fn local_with(world: usize, config: NodeConfig) -> Result<SyncCluster> {
        not_in_runtime()?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name("nexar")
            .build()
            .map_err(|e| NexarError::Actor(format!("cannot start a tokio runtime: {e}")))?;
        let cluster = runtime.block_on(Cluster::local_with(world, config))?;
        Ok(SyncCluster {
            runtime: Arc::new(OwnedRuntime(Some(runtime))),
            cluster: Some(cluster),
        })
    }

    /// One blocking communicator per rank, in rank order.
    pub fn communicators(&self) -> Vec<SyncCommunicator> {
        self.cluster
            .iter()
            .flat_map(|c| c.communicators())
            .map(|comm| SyncCommunicator {
                comm,
                runtime: self.runtime.clone(),
            })
            .collect()
    }
}

impl Drop for SyncCluster {
    fn drop(&mut self) {
        if let Some(c) = self.cluster.take() {
            if tokio::runtime::Handle::try_current().is_err() {
                self.runtime.block_on(c.shutdown());
            }
        }
    }
}

fn not_in_runtime() -> Result<()> {
    if tokio::runtime::Handle::try_current().is_ok() {
        return Err(NexarError::InvalidArgument(
            "the blocking API cannot be used from inside an async runtime; use Communicator".into(),
        ));
    }
    Ok(())
}

/// A [`Communicator`] whose calls block the calling thread. Each rank is usually driven
/// from its own thread. Calls from inside an async runtime are refused with an error.
#[derive(Clone, Debug)]
pub struct SyncCommunicator {
    comm: Communicator,
    runtime: Arc<OwnedRuntime>,
}

impl SyncCommunicator {
    fn block<R>(&self, f: impl std::future::Future<Output = Result<R>>) -> Result<R> {
        not_in_runtime()?;
        self.runtime.block_on(f)
    }

    /// The async communicator behind this facade. Its calls need a tokio runtime: run
    /// them with [`block_on`](Self::block_on).
    pub fn inner(&self) -> &Communicator {
        &self.comm
    }

    /// Runs `f` to its end on this facade's runtime and returns its output: for the calls
    /// this facade has no blocking form of (RPC, `shrink`, the `_nb`, `_in_place`,
    /// `_zero_copy` and `_in` forms...), made on [`inner`](Self::inner) inside `f`.
    /// Refused with [`NexarError::InvalidArgument`] inside an async runtime, like every
    /// blocking call.
    pub fn block_on<F: std::future::Future>(&self, f: F) -> Result<F::Output> {
        not_in_runtime()?;
        Ok(self.runtime.block_on(f))
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    /// Blocking [`Communicator::send`].
    pub fn send<T: Element>(&self, data: &[T], dst: usize, tag: u64) -> Result<()> {
        self.block(self.comm.send(data, dst, tag))
    }

    /// Blocking [`Communicator::send_bytes`].
    pub fn send_bytes(&self, data: bytes::Bytes, dst: usize, tag: u64) -> Result<()> {
        self.block(self.comm.send_bytes(data, dst, tag))
    }

    /// Blocking [`Communicator::recv`].
    pub fn recv<T: Element>(&self, buf: &mut [T], src: usize, tag: u64) -> Result<()> {
        self.block(self.comm.recv(buf, src, tag))
    }

    /// Blocking [`Communicator::barrier`].
    pub fn barrier(&self) -> Result<()> {
        self.block(self.comm.barrier())
    }

    /// Blocking [`Communicator::all_reduce`].
    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.block(self.comm.all_reduce(buf, op))
    }

    /// Blocking [`Communicator::broadcast`].
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.block(self.comm.broadcast(buf, root))
    }

    /// Blocking [`Communicator::reduce`].
    pub fn reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        self.block(self.comm.reduce(buf, op, root))
    }

    /// Blocking [`Communicator::all_gather`].
    pub fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.block(self.comm.all_gather(send, recv))
    }

    /// Blocking [`Communicator::reduce_scatter`].
    pub fn reduce_scatter<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.block(self.comm.reduce_scatter(send, recv, op))
    }

    /// Blocking [`Communicator::gather`].
    pub fn gather<T: Element>(&self, send: &[T], recv: &mut [T], root: usize) -> Result<()> {
        self.block(self.comm.gather(send, recv, root))
    }

    /// Blocking [`Communicator::scatter`].
    pub fn scatter<T: Element>(&self, send: &[T], recv: &mut [T], root: usize) -> Result<()> {
        self.block(self.comm.scatter(send, recv, root))
    }

    /// Blocking [`Communicator::all_to_all`].
    pub fn all_to_all<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.block(self.comm.all_to_all(send, recv))
    }

    /// Blocking [`Communicator::scan`].
    pub fn scan<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.block(self.comm.scan(buf, op))
    }

    /// Blocking [`Communicator::exclusive_scan`].
    pub fn exclusive_scan<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.block(self.comm.exclusive_scan(buf, op))
    }

    /// Blocking [`Communicator::split`].
    pub fn split(&self, color: u32, key: u32) -> Result<SyncCommunicator> {
        let comm = self.block(self.comm.split(color, key))?;
        Ok(SyncCommunicator {
            comm,
            runtime: self.runtime.clone(),
        })
    }
}
