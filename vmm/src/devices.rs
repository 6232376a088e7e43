//! Port-I/O devices: a 16550 UART on COM1 (vm-superio), the i8042 reset line
//! as the guest's way to shut down, and an idle port for ring-3 guests.
//!
//! The VM's device thread (one per VM that has devices fed from the host
//! side) polls those devices' descriptors and lets them fill the guest's
//! queues; see [`DeviceThread`].
//!
//! The idle port (`0x510`) is Twig's stand-in for `hlt` where a guest runs in
//! ring 3 (as the test guests must on this machine, where ring 0 is emulated):
//! a write parks the vCPU in the VMM until the host kicks it, so idle guests
//! cost no CPU.

use std::io::Write;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vm_superio::serial::{NoEvents, SerialState};
use vm_superio::{I8042Device, Serial, Trigger};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::error::{Error, Result};
use crate::ratelimit::warn_limited;
use crate::virtio::{self, MmioTransport, TransportState};

/// COM1 base port.
pub const COM1: u16 = 0x3f8;
/// COM1 interrupt line.
pub const COM1_IRQ: u32 = 4;
/// i8042 data and command ports.
const I8042_DATA: u16 = 0x60;
const I8042_CMD: u16 = 0x64;
/// The idle port.
pub const IDLE_PORT: u16 = 0x510;

/// Where serial output goes.
pub type SerialOut = Box<dyn Write + Send>;

/// Why the guest stopped running.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GuestExit {
    /// The guest asked for a reset through the i8042 (how Linux powers off
    /// with `reboot=k`).
    Reset,
    /// The guest triple-faulted (KVM_EXIT_SHUTDOWN).
    TripleFault,
    /// KVM reported a system event (shutdown, reset, crash).
    SystemEvent(u32),
    /// KVM could not run the vCPU.
    Failed(String),
}

/// The guest's exit, once it happened; waitable.
#[derive(Default)]
pub struct ExitState {
    exit: Mutex<Option<GuestExit>>,
    cv: Condvar,
}

impl ExitState {
    /// Records the first exit; later ones are ignored.
    pub fn set(&self, e: GuestExit) {
        let mut g = self.exit.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            *g = Some(e);
        }
        self.cv.notify_all();
    }

    /// The exit, if the guest has stopped.
    pub fn get(&self) -> Option<GuestExit> {
        self.exit.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Waits up to `timeout` for the guest to stop.
    pub fn wait(&self, timeout: Duration) -> Option<GuestExit> {
        let deadline = Instant::now() + timeout;
        let mut g = self.exit.lock().unwrap_or_else(|p| p.into_inner());
        while g.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            g = self
                .cv
                .wait_timeout(g, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        g.clone()
    }

    /// Forgets the exit (the VM was rolled back to a running state).
    pub fn clear(&self) {
        *self.exit.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

/// Raises COM1's interrupt line through a KVM irqfd.
pub struct IrqTrigger(pub EventFd);

impl Trigger for IrqTrigger {
    type E = std::io::Error;
    fn trigger(&self) -> std::io::Result<()> {
        self.0.write(1)
    }
}

/// Records a guest-requested reset.
pub struct ResetTrigger(Arc<ExitState>);

impl Trigger for ResetTrigger {
    type E = std::io::Error;
    fn trigger(&self) -> std::io::Result<()> {
        self.0.set(GuestExit::Reset);
        Ok(())
    }
}

/// What a port write asks of the vCPU loop.
#[derive(Debug, PartialEq, Eq)]
pub enum PioAction {
    /// Carry on.
    Continue,
    /// Park until kicked.
    Idle,
}

type Uart = Serial<IrqTrigger, NoEvents, SerialOut>;

/// The VM's devices: port I/O and virtio-mmio.
pub struct Devices {
    serial: Mutex<Uart>,
    i8042: Mutex<I8042Device<ResetTrigger>>,
    virtio: Vec<Mutex<MmioTransport>>,
    exit: Arc<ExitState>,
}

/// Device state parsed from a snapshot, validated, ready to apply.
pub struct DeviceState {
    serial: SerialState,
    virtio: Vec<TransportState>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Devices {
    /// Creates the devices; `irq` is the eventfd registered for COM1's IRQ,
    /// `virtio` the virtio-mmio transports in address order.
    pub fn new(
        out: SerialOut,
        irq: EventFd,
        virtio: Vec<MmioTransport>,
        exit: Arc<ExitState>,
    ) -> Devices {
        Devices {
            serial: Mutex::new(Serial::new(IrqTrigger(irq), out)),
            i8042: Mutex::new(I8042Device::new(ResetTrigger(exit.clone()))),
            virtio: virtio.into_iter().map(Mutex::new).collect(),
            exit,
        }
    }

    /// The kernel command-line parameters that announce the virtio devices.
    pub fn virtio_cmdline(&self) -> String {
        (0..self.virtio.len())
            .map(|i| {
                format!(
                    " virtio_mmio.device=4K@{:#x}:{}",
                    virtio::MMIO_BASE + i as u64 * virtio::MMIO_SIZE,
                    virtio::IRQ_BASE + i as u32
                )
            })
            .collect()
    }

    fn virtio_at(&self, addr: u64) -> Option<(&Mutex<MmioTransport>, u64)> {
        let rel = addr.checked_sub(virtio::MMIO_BASE)?;
        let dev = self.virtio.get((rel / virtio::MMIO_SIZE) as usize)?;
        Some((dev, rel % virtio::MMIO_SIZE))
    }

    /// Handles an MMIO read; nothing there reads as all ones.
    pub fn mmio_read(&self, addr: u64, data: &mut [u8]) {
        match self.virtio_at(addr) {
            Some((dev, off)) => lock(dev).read(off, data),
            None => data.iter_mut().for_each(|b| *b = 0xff),
        }
    }

    /// Handles an MMIO write.
    pub fn mmio_write(&self, addr: u64, data: &[u8]) {
        if let Some((dev, off)) = self.virtio_at(addr) {
            lock(dev).write(off, data);
        }
    }

    /// The transport of virtio device `index`.
    pub fn transport(&self, index: usize) -> Option<&Mutex<MmioTransport>> {
        self.virtio.get(index)
    }

    /// The guest's exit state.
    pub fn exit(&self) -> &Arc<ExitState> {
        &self.exit
    }

    /// Handles a port write.
    pub fn pio_write(&self, port: u16, data: &[u8]) -> PioAction {
        let Some(&value) = data.first() else {
            return PioAction::Continue;
        };
        match port {
            COM1..=0x3ff => {
                if let Err(e) = lock(&self.serial).write((port - COM1) as u8, value) {
                    warn_limited!("serial write failed: {e:?}");
                }
            }
            I8042_DATA | I8042_CMD => {
                if let Err(e) = lock(&self.i8042).write((port - I8042_DATA) as u8, value) {
                    warn_limited!("i8042 write failed: {e}");
                }
            }
            IDLE_PORT => return PioAction::Idle,
            _ => {}
        }
        PioAction::Continue
    }

    /// Handles a port read; unknown ports read as all ones.
    pub fn pio_read(&self, port: u16, data: &mut [u8]) {
        let value = match port {
            COM1..=0x3ff => lock(&self.serial).read((port - COM1) as u8),
            I8042_DATA | I8042_CMD => lock(&self.i8042).read((port - I8042_DATA) as u8),
            _ => 0xff,
        };
        data.iter_mut().for_each(|b| *b = value);
    }

    /// Flushes serial output.
    pub fn flush(&self) {
        if let Err(e) = lock(&self.serial).writer_mut().flush() {
            tracing::warn!("flushing serial output: {e}");
        }
    }

    /// Device state for a snapshot: the UART's registers and each virtio
    /// transport's state, each length-prefixed.
    pub fn save(&self) -> Vec<u8> {
        let s = lock(&self.serial).state();
        let mut serial = vec![
            s.baud_divisor_low,
            s.baud_divisor_high,
            s.interrupt_enable,
            s.interrupt_identification,
            s.line_control,
            s.line_status,
            s.modem_control,
            s.modem_status,
            s.scratch,
        ];
        serial.extend_from_slice(&s.in_buffer);
        let mut out = Vec::new();
        let mut blob = |b: &[u8]| {
            out.extend_from_slice(&(b.len() as u32).to_le_bytes());
            out.extend_from_slice(b);
        };
        blob(&serial);
        blob(&(self.virtio.len() as u32).to_le_bytes());
        for v in &self.virtio {
            let v = lock(v);
            let mut b = v.device_type().to_le_bytes().to_vec();
            b.extend_from_slice(&v.save());
            blob(&b);
        }
        out
    }

    /// The virtio device ids, in MMIO order.
    pub fn virtio_types(&self) -> Vec<u32> {
        self.virtio.iter().map(|v| lock(v).device_type()).collect()
    }

    /// The virtio device ids recorded in device state saved by
    /// [`Devices::save`].
    pub fn saved_virtio_types(state: &[u8]) -> Result<Vec<u32>> {
        Ok(split_state(state)?.1.iter().map(|(t, _)| *t).collect())
    }

    /// Parses and validates device state saved by [`Devices::save`] for
    /// these devices, without applying it.
    pub fn parse(&self, state: &[u8]) -> Result<DeviceState> {
        let bad = |what: &str| Error::Config(format!("device state is malformed: {what}"));
        let (s, saved) = split_state(state)?;
        if s.len() < 9 || s.len() > 9 + 64 {
            return Err(bad("serial"));
        }
        let serial = SerialState {
            baud_divisor_low: s[0],
            baud_divisor_high: s[1],
            interrupt_enable: s[2],
            interrupt_identification: s[3],
            line_control: s[4],
            line_status: s[5],
            modem_control: s[6],
            modem_status: s[7],
            scratch: s[8],
            in_buffer: s[9..].to_vec(),
        };
        let theirs: Vec<u32> = saved.iter().map(|(t, _)| *t).collect();
        let ours = self.virtio_types();
        if theirs != ours {
            return Err(Error::Config(format!(
                "the snapshot's virtio devices differ from this VM's: {}",
                describe_difference(&theirs, &ours)
            )));
        }
        let mut virtio = Vec::with_capacity(self.virtio.len());
        for (v, (_, b)) in self.virtio.iter().zip(saved) {
            virtio.push(lock(v).parse(b)?);
        }
        Ok(DeviceState { serial, virtio })
    }

    /// Raises again every interrupt the devices' state says is pending. An
    /// interrupt a device raised just before a snapshot can still have been
    /// on its way through the irqfd into KVM's irqchip when the irqchip was
    /// saved; without this, a restored guest would wait for it forever.
    /// A spurious one is harmless: drivers read the device's status first.
    pub fn retrigger_pending(&self) {
        let serial = lock(&self.serial);
        if serial.state().interrupt_identification & 1 == 0 {
            if let Err(e) = serial.interrupt_evt().trigger() {
                tracing::warn!("serial interrupt: {e}");
            }
        }
        drop(serial);
        for v in &self.virtio {
            lock(v).retrigger_pending();
        }
    }

    /// Every virtio transport's and device's state, for diagnostics.
    pub fn describe(&self) -> Vec<String> {
        self.virtio.iter().map(|v| lock(v).describe()).collect()
    }

    /// Tells the driver of virtio device `index` (MMIO order) that its
    /// configuration changed, if it did (see
    /// [`MmioTransport::announce_config`]).
    pub fn announce_config(&self, index: usize) {
        if let Some(v) = self.virtio.get(index) {
            lock(v).announce_config();
        }
    }

    /// Tells every virtio device its state was restored or rolled back.
    pub fn after_restore(&self) {
        for v in &self.virtio {
            lock(v).after_restore();
        }
    }

    /// Applies parsed device state. Everything that can fail happens
    /// before any device changes, so an error leaves them as they were.
    pub fn restore(&self, state: DeviceState) -> Result<()> {
        let mut serial = lock(&self.serial);
        let irq = serial
            .interrupt_evt()
            .0
            .try_clone()
            .map_err(|e| Error::io("cloning the serial irqfd", e))?;
        let mut restored = Serial::from_state(
            &state.serial,
            IrqTrigger(irq),
            NoEvents,
            Box::new(std::io::sink()) as SerialOut,
        )
        .map_err(|e| Error::Config(format!("serial state: {e:?}")))?;
        std::mem::swap(restored.writer_mut(), serial.writer_mut());
        *serial = restored;
        drop(serial);
        for (v, s) in self.virtio.iter().zip(state.virtio) {
            lock(v).apply(s);
        }
        Ok(())
    }
}

/// "the snapshot has rng, block; this VM has rng, block, net".
pub fn describe_difference(snapshot: &[u32], vm: &[u32]) -> String {
    let names = |v: &[u32]| {
        v.iter()
            .map(|t| virtio::device_name(*t))
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        "the snapshot has {}; this VM has {}",
        names(snapshot),
        names(vm)
    )
}

/// Saved device state, split: the serial blob and each virtio device's type
/// and transport state.
type SplitState<'a> = (&'a [u8], Vec<(u32, &'a [u8])>);

/// Splits saved device state saved by [`Devices::save`].
fn split_state(state: &[u8]) -> Result<SplitState<'_>> {
    let bad = |what: &str| Error::Config(format!("device state is malformed: {what}"));
    let mut r = state;
    let mut blob = || -> Result<&[u8]> {
        if r.len() < 4 {
            return Err(bad("truncated"));
        }
        let n = u32::from_le_bytes([r[0], r[1], r[2], r[3]]) as usize;
        if r.len() < 4 + n {
            return Err(bad("truncated"));
        }
        let (b, rest) = r[4..].split_at(n);
        r = rest;
        Ok(b)
    };
    let serial = blob()?;
    let count = blob()?;
    let count = match count {
        [a, b, c, d] => u32::from_le_bytes([*a, *b, *c, *d]) as usize,
        _ => return Err(bad("virtio device count")),
    };
    if count > virtio::MAX_DEVICES {
        return Err(bad("too many virtio devices"));
    }
    let mut virtio = Vec::with_capacity(count);
    for _ in 0..count {
        let b = blob()?;
        if b.len() < 4 {
            return Err(bad("virtio device type"));
        }
        let (t, rest) = b.split_at(4);
        virtio.push((u32::from_le_bytes([t[0], t[1], t[2], t[3]]), rest));
    }
    if !r.is_empty() {
        return Err(bad("trailing bytes"));
    }
    Ok((serial, virtio))
}

/// What the VM wants of its device thread.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Order {
    Run,
    Pause,
    Exit,
}

struct ThreadCtl {
    order: Order,
    paused: bool,
}

struct ThreadShared {
    ctl: Mutex<ThreadCtl>,
    cv: Condvar,
}

/// How long [`DeviceThread::pause`] waits for the thread to stop.
const DEVICE_PAUSE_TIMEOUT: Duration = Duration::from_secs(10);
const WAKE: u64 = u64::MAX;

/// The thread that serves the host side of a VM's devices (network frames,
/// vsock connections): it polls every transport's
/// [`MmioTransport::host_fd`] and an eventfd for control, and calls
/// [`MmioTransport::process_host`] on readability. It starts paused; the VM
/// resumes it with its vCPUs and pauses it (waiting for the
/// acknowledgement) before it saves or loads device state.
pub struct DeviceThread {
    shared: Arc<ThreadShared>,
    wake: EventFd,
    thread: Option<JoinHandle<()>>,
}

impl DeviceThread {
    /// Starts a paused device thread for `devices`, or none if no device has
    /// a host descriptor.
    pub fn spawn(devices: &Arc<Devices>) -> Result<Option<DeviceThread>> {
        let fds: Vec<(usize, i32)> = devices
            .virtio
            .iter()
            .enumerate()
            .filter_map(|(i, v)| lock(v).host_fd().map(|fd| (i, fd)))
            .collect();
        if fds.is_empty() {
            return Ok(None);
        }
        let wake = EventFd::new(EFD_NONBLOCK).map_err(|e| Error::io("creating an eventfd", e))?;
        let epoll = Epoll::new().map_err(|e| Error::io("creating the device epoll", e))?;
        epoll
            .ctl(
                ControlOperation::Add,
                wake.as_raw_fd(),
                EpollEvent::new(EventSet::IN, WAKE),
            )
            .map_err(|e| Error::io("polling the device thread's eventfd", e))?;
        for &(i, fd) in &fds {
            epoll
                .ctl(
                    ControlOperation::Add,
                    fd,
                    EpollEvent::new(EventSet::IN, i as u64),
                )
                .map_err(|e| Error::io(format!("polling virtio device {i}"), e))?;
            let w = wake
                .try_clone()
                .map_err(|e| Error::io("cloning an eventfd", e))?;
            lock(&devices.virtio[i]).set_host_wake(w);
        }
        let shared = Arc::new(ThreadShared {
            ctl: Mutex::new(ThreadCtl {
                order: Order::Pause,
                paused: false,
            }),
            cv: Condvar::new(),
        });
        let worker = Worker {
            shared: shared.clone(),
            devices: devices.clone(),
            wake: wake
                .try_clone()
                .map_err(|e| Error::io("cloning an eventfd", e))?,
            epoll,
            fds,
        };
        let thread = std::thread::Builder::new()
            .name("twig-devices".into())
            .stack_size(256 * 1024)
            .spawn(move || {
                crate::jail::seccomp::thread_start(crate::jail::seccomp::Role::Device);
                worker.run()
            })
            .map_err(|e| Error::io("spawning the device thread", e))?;
        let t = DeviceThread {
            shared,
            wake,
            thread: Some(thread),
        };
        t.pause()?;
        Ok(Some(t))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ThreadCtl> {
        lock(&self.shared.ctl)
    }

    fn poke(&self) {
        if let Err(e) = self.wake.write(1) {
            tracing::warn!("waking the device thread: {e}");
        }
    }

    /// Stops the thread touching devices and waits until it says it has.
    pub fn pause(&self) -> Result<()> {
        let mut c = self.lock();
        if c.order == Order::Run {
            c.order = Order::Pause;
        }
        drop(c);
        self.poke();
        let c = self.lock();
        let (_guard, waited) = self
            .shared
            .cv
            .wait_timeout_while(c, DEVICE_PAUSE_TIMEOUT, |c| {
                !(c.paused && c.order == Order::Pause)
            })
            .unwrap_or_else(|p| p.into_inner());
        if waited.timed_out() {
            return Err(Error::PauseTimedOut {
                what: "the device thread".into(),
                waited: DEVICE_PAUSE_TIMEOUT,
            });
        }
        Ok(())
    }

    /// Lets the thread serve devices again (and look at every descriptor).
    pub fn resume(&self) {
        let mut c = self.lock();
        if c.order == Order::Pause {
            c.order = Order::Run;
        }
        self.shared.cv.notify_all();
        drop(c);
        self.poke();
    }
}

impl Drop for DeviceThread {
    fn drop(&mut self) {
        self.lock().order = Order::Exit;
        self.shared.cv.notify_all();
        self.poke();
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::error!("the device thread panicked");
            }
        }
    }
}

struct Worker {
    shared: Arc<ThreadShared>,
    devices: Arc<Devices>,
    wake: EventFd,
    epoll: Epoll,
    fds: Vec<(usize, i32)>,
}

impl Worker {
    /// Waits while paused; false once told to exit.
    fn wait_for_run(&self) -> bool {
        let mut c = lock(&self.shared.ctl);
        loop {
            match c.order {
                Order::Exit => return false,
                Order::Run => {
                    c.paused = false;
                    return true;
                }
                Order::Pause => {
                    if !c.paused {
                        c.paused = true;
                        self.shared.cv.notify_all();
                    }
                    c = self.shared.cv.wait(c).unwrap_or_else(|p| p.into_inner());
                }
            }
        }
    }

    /// After a fatal error: still acknowledges pauses, until told to exit.
    fn obey_without_serving(&self) {
        let mut c = lock(&self.shared.ctl);
        while c.order != Order::Exit {
            c.paused = true;
            self.shared.cv.notify_all();
            c = self.shared.cv.wait(c).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn running(&self) -> bool {
        lock(&self.shared.ctl).order == Order::Run
    }

    fn set_polled(&self, fd: i32, index: usize, on: bool) {
        let events = if on { EventSet::IN } else { EventSet::empty() };
        if let Err(e) = self.epoll.ctl(
            ControlOperation::Modify,
            fd,
            EpollEvent::new(events, index as u64),
        ) {
            tracing::warn!("device thread: polling virtio device {index}: {e}");
        }
    }

    fn run(self) {
        let mut events = vec![EpollEvent::default(); self.fds.len() + 1];
        let mut idle = vec![false; self.fds.len()];
        'outer: while self.wait_for_run() {
            let n = match self.epoll.wait(-1, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::error!("device thread: epoll_wait: {e}; host-fed devices stop");
                    self.obey_without_serving();
                    return;
                }
            };
            for ev in &events[..n] {
                if ev.data() == WAKE {
                    let _ = self.wake.read();
                    // A driver came up, or the VM resumed: poll every
                    // descriptor again.
                    for (slot, &(i, fd)) in self.fds.iter().enumerate() {
                        if idle[slot] {
                            self.set_polled(fd, i, true);
                            idle[slot] = false;
                        }
                    }
                    continue;
                }
                if !self.running() {
                    continue 'outer;
                }
                let index = ev.data() as usize;
                let Some(slot) = self.fds.iter().position(|(i, _)| *i == index) else {
                    continue;
                };
                let live = lock(&self.devices.virtio[index]).process_host();
                if !live {
                    // The driver is not up: nothing can move until it is.
                    self.set_polled(self.fds[slot].1, index, false);
                    idle[slot] = true;
                }
            }
        }
    }
}

/// Serial output kept in memory, shareable, with waits on its contents.
/// Tests and the benchmark use it to see what the guest printed.
#[derive(Clone, Default)]
pub struct Capture(Arc<(Mutex<Vec<u8>>, Condvar)>);

impl Capture {
    /// A new, empty capture.
    pub fn new() -> Capture {
        Capture::default()
    }

    /// A writer that appends to this capture.
    pub fn writer(&self) -> SerialOut {
        Box::new(self.clone())
    }

    /// Everything captured so far.
    pub fn bytes(&self) -> Vec<u8> {
        lock(&self.0 .0).clone()
    }

    /// Waits until `pattern` appears at or after byte `from`; returns the
    /// offset just past it, or an error naming what was seen by the deadline.
    pub fn wait_for(&self, pattern: &[u8], from: usize, timeout: Duration) -> Result<usize> {
        let deadline = Instant::now() + timeout;
        let mut buf = lock(&self.0 .0);
        loop {
            if let Some(tail) = buf.get(from..) {
                if let Some(i) = tail.windows(pattern.len()).position(|w| w == pattern) {
                    return Ok(from + i + pattern.len());
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Config(format!(
                    "serial output {:?} did not show {:?} within {timeout:?}",
                    String::from_utf8_lossy(&buf),
                    String::from_utf8_lossy(pattern)
                )));
            }
            buf = self
                .0
                 .1
                .wait_timeout(buf, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

impl Write for Capture {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        lock(&self.0 .0).extend_from_slice(data);
        self.0 .1.notify_all();
        Ok(data.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::GuestRam;
    use crate::virtio::VirtioDevice;
    use std::os::fd::RawFd;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use virtio_bindings::virtio_config::{
        VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK,
        VIRTIO_CONFIG_S_FEATURES_OK,
    };
    use virtio_bindings::virtio_mmio::VIRTIO_MMIO_STATUS;
    use virtio_queue::Queue;

    /// A device whose host descriptor is always readable.
    struct Firehose {
        fd: EventFd,
        calls: Arc<AtomicUsize>,
        paused: Arc<AtomicBool>,
        violations: Arc<AtomicUsize>,
    }

    impl VirtioDevice for Firehose {
        fn device_type(&self) -> u32 {
            42
        }
        fn features(&self) -> u64 {
            0
        }
        fn queue_max_sizes(&self) -> &[u16] {
            &[16]
        }
        fn read_config(&self, _offset: u64, _data: &mut [u8]) {}
        fn process_queue(
            &mut self,
            _: usize,
            _: &mut [Queue],
            _: &crate::memory::GuestMem,
        ) -> bool {
            false
        }
        fn host_fd(&self) -> Option<RawFd> {
            Some(self.fd.as_raw_fd())
        }
        fn process_host(&mut self, _: &mut [Queue], _: &crate::memory::GuestMem) -> bool {
            if self.paused.load(Ordering::SeqCst) {
                self.violations.fetch_add(1, Ordering::SeqCst);
            }
            self.calls.fetch_add(1, Ordering::SeqCst);
            false
        }
    }

    fn wait_until(what: &str, f: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !f() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::yield_now();
        }
    }

    #[test]
    fn the_device_thread_pauses_and_resumes_under_a_busy_host_fd() {
        let ram = GuestRam::reserve(1 << 20).unwrap();
        let (calls, paused, violations) = (
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicBool::new(true)),
            Arc::new(AtomicUsize::new(0)),
        );
        let fd = EventFd::new(EFD_NONBLOCK).unwrap();
        fd.write(1).unwrap();
        let dev = Firehose {
            fd,
            calls: calls.clone(),
            paused: paused.clone(),
            violations: violations.clone(),
        };
        let irq = EventFd::new(EFD_NONBLOCK).unwrap();
        let t = MmioTransport::new(Box::new(dev), irq, ram.memory().clone()).unwrap();
        let devices = Arc::new(Devices::new(
            Box::new(std::io::sink()),
            EventFd::new(EFD_NONBLOCK).unwrap(),
            vec![t],
            Arc::new(ExitState::default()),
        ));
        let thread = DeviceThread::spawn(&devices)
            .unwrap()
            .expect("a device thread");

        // The driver is not up: the thread runs but does not spin on the
        // device; bringing the driver up wakes it.
        paused.store(false, Ordering::SeqCst);
        thread.resume();
        thread.pause().unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 0, "not live, not served");
        thread.resume();
        let status = VIRTIO_CONFIG_S_ACKNOWLEDGE
            | VIRTIO_CONFIG_S_DRIVER
            | VIRTIO_CONFIG_S_FEATURES_OK
            | VIRTIO_CONFIG_S_DRIVER_OK;
        devices.mmio_write(
            virtio::MMIO_BASE + u64::from(VIRTIO_MMIO_STATUS),
            &status.to_le_bytes(),
        );
        wait_until("the device to be served", || {
            calls.load(Ordering::SeqCst) > 0
        });

        for _ in 0..100 {
            thread.pause().unwrap();
            paused.store(true, Ordering::SeqCst);
            // What snapshot, restore and rollback do meanwhile.
            let saved = devices.save();
            devices.restore(devices.parse(&saved).unwrap()).unwrap();
            devices.after_restore();
            let before = calls.load(Ordering::SeqCst);
            paused.store(false, Ordering::SeqCst);
            thread.resume();
            wait_until("the device to be served again", || {
                calls.load(Ordering::SeqCst) > before
            });
        }
        assert_eq!(violations.load(Ordering::SeqCst), 0, "served while paused");
        drop(thread);
        assert_eq!(Arc::strong_count(&devices), 1, "the thread let go");
    }
}
