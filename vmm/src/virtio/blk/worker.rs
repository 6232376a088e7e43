//! The per-disk I/O worker: one thread per virtio-blk device serves its
//! requests, so that the vCPU that notifies the queue only wakes it and
//! goes back to the guest at once. A guest's slow writes and flushes then
//! hold this thread, never a vCPU, and a pause (snapshot, rollback) is never
//! blocked by a vCPU stuck in disk I/O.
//!
//! Why a thread per disk rather than the VM's device thread (Firecracker
//! serves block on its one event loop): a slow disk must not stall the
//! network and vsock, and the worker must not hold the transport's lock
//! while it does I/O, or a vCPU touching the device's registers (an
//! interrupt acknowledgement, the next notify) would wait on that lock.
//! The worker takes one request off the queue under the lock
//! ([`MmioTransport::pop_request`]), serves it without the lock, and puts
//! it in the used ring under the lock ([`MmioTransport::complete`]).
//!
//! **Pausing stops the worker between requests.** A pause asks it to stop
//! and waits, up to a bound, for the request in hand to finish: a snapshot
//! never holds a request taken off the queue but not in the used ring, and
//! a request is never cut short (an interrupted write would leave the disk
//! neither old nor new while the guest is told nothing). A request that
//! does not finish within the bound (a 254 MiB write on a slow host disk)
//! fails the pause cleanly: the VM's pause is withdrawn and everything runs
//! on (see `Vm::pause`). Notifies while paused are remembered, and every
//! resume looks at the queue again (a restore or rollback changes it).

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use super::Server;
use crate::devices::Devices;
use crate::error::{Error, Result};
use crate::memory::GuestMem;

/// What the VM wants of the worker.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
enum Order {
    Run,
    #[default]
    Pause,
    Exit,
}

#[derive(Default)]
struct State {
    order: Order,
    /// The driver notified the queue since the worker last looked.
    kicked: bool,
    /// The worker waits, holding no request.
    idle: bool,
}

/// The handle shared by the device (which kicks) and the worker.
#[derive(Default)]
pub struct Control {
    state: Mutex<State>,
    cv: Condvar,
}

impl Control {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The driver notified the queue: wake the worker.
    pub(super) fn kick(&self) {
        self.lock().kicked = true;
        self.cv.notify_all();
    }

    fn set_order(&self, order: Order, kick: bool) {
        let mut s = self.lock();
        if s.order != Order::Exit {
            s.order = order;
        }
        s.kicked |= kick;
        drop(s);
        self.cv.notify_all();
    }

    fn running(&self) -> bool {
        self.lock().order == Order::Run
    }
}

/// A disk's I/O worker thread; it starts paused and stops when dropped.
pub struct DiskWorker {
    control: Arc<Control>,
    thread: Option<JoinHandle<()>>,
}

impl DiskWorker {
    /// Starts the worker of the block device `index` of `devices` (made by
    /// [`super::Blk::with_worker`], which gave `control`) serving `disk`.
    pub fn spawn(
        control: Arc<Control>,
        devices: Arc<Devices>,
        index: usize,
        disk: Arc<super::DiskFile>,
        mem: GuestMem,
    ) -> Result<DiskWorker> {
        let worker = Worker {
            control: control.clone(),
            devices,
            index,
            server: Server::new(disk),
            mem,
        };
        let thread = std::thread::Builder::new()
            .name(format!("twig-disk{index}"))
            .stack_size(256 * 1024)
            .spawn(move || {
                crate::jail::seccomp::thread_start(crate::jail::seccomp::Role::Device);
                worker.run()
            })
            .map_err(|e| Error::io("spawning a disk I/O thread", e))?;
        Ok(DiskWorker {
            control,
            thread: Some(thread),
        })
    }

    /// Asks the worker to stop after the request in hand.
    pub fn request_pause(&self) {
        self.control.set_order(Order::Pause, false);
    }

    /// Waits until the worker holds no request, at most until `deadline`;
    /// false if it still does then.
    pub fn wait_paused(&self, deadline: Instant) -> bool {
        let mut s = self.control.lock();
        while !(s.idle && s.order != Order::Run) {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return false;
            };
            s = match self.control.cv.wait_timeout(s, left) {
                Ok((s, _)) => s,
                Err(p) => p.into_inner().0,
            };
        }
        true
    }

    /// Lets the worker serve again, starting with a look at the queue.
    pub fn resume(&self) {
        self.control.set_order(Order::Run, true);
    }
}

impl Drop for DiskWorker {
    fn drop(&mut self) {
        self.control.set_order(Order::Exit, false);
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::error!("a disk I/O thread panicked");
            }
        }
    }
}

struct Worker {
    control: Arc<Control>,
    devices: Arc<Devices>,
    index: usize,
    server: Server,
    mem: GuestMem,
}

impl Worker {
    /// Waits, idle, until running and kicked; false once told to exit.
    fn wait_for_work(&self) -> bool {
        let mut s = self.control.lock();
        loop {
            match s.order {
                Order::Exit => return false,
                Order::Run if s.kicked => {
                    s.kicked = false;
                    s.idle = false;
                    return true;
                }
                _ => {
                    if !s.idle {
                        s.idle = true;
                        self.control.cv.notify_all();
                    }
                    s = self.control.cv.wait(s).unwrap_or_else(|p| p.into_inner());
                }
            }
        }
    }

    fn run(mut self) {
        let Some(transport) = self.devices.transport(self.index) else {
            tracing::error!(device = self.index, "disk I/O thread: no such device");
            return;
        };
        while self.wait_for_work() {
            // One request at a time, looking for a pause between them.
            while self.control.running() {
                let taken = transport
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .pop_request(0);
                let Some(popped) = taken else {
                    break;
                };
                let len = self.server.request(&popped.descs, &self.mem);
                transport
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .complete(0, &popped, len);
            }
        }
    }
}
