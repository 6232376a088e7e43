//! Port-I/O devices: a 16550 UART on COM1 (vm-superio), the i8042 reset line
//! as the guest's way to shut down, and an idle port for ring-3 guests.
//!
//! The idle port (`0x510`) is Twig's stand-in for `hlt` where a guest runs in
//! ring 3 (as the test guests must on this machine, where ring 0 is emulated):
//! a write parks the vCPU in the VMM until the host kicks it, so idle guests
//! cost no CPU.

use std::io::Write;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use vm_superio::serial::{NoEvents, SerialState};
use vm_superio::{I8042Device, Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

use crate::error::{Error, Result};
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
                    tracing::warn!("serial write failed: {e:?}");
                }
            }
            I8042_DATA | I8042_CMD => {
                if let Err(e) = lock(&self.i8042).write((port - I8042_DATA) as u8, value) {
                    tracing::warn!("i8042 write failed: {e}");
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
            blob(&lock(v).save());
        }
        out
    }

    /// Parses and validates device state saved by [`Devices::save`] for
    /// these devices, without applying it.
    pub fn parse(&self, state: &[u8]) -> Result<DeviceState> {
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
        let s = blob()?;
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
        let count = blob()?;
        if count != (self.virtio.len() as u32).to_le_bytes() {
            return Err(bad("the snapshot has other virtio devices"));
        }
        let mut virtio = Vec::with_capacity(self.virtio.len());
        for v in &self.virtio {
            let b = blob()?;
            virtio.push(lock(v).parse(b)?);
        }
        if !r.is_empty() {
            return Err(bad("trailing bytes"));
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

    /// Applies parsed device state.
    pub fn restore(&self, state: DeviceState) -> Result<()> {
        for (v, s) in self.virtio.iter().zip(state.virtio) {
            lock(v).apply(s);
        }
        let mut serial = lock(&self.serial);
        let irq = serial
            .interrupt_evt()
            .0
            .try_clone()
            .map_err(|e| Error::io("cloning the serial irqfd", e))?;
        let out: SerialOut = Box::new(std::mem::replace(
            serial.writer_mut(),
            Box::new(std::io::sink()),
        ));
        *serial = Serial::from_state(&state.serial, IrqTrigger(irq), NoEvents, out)
            .map_err(|e| Error::Config(format!("serial state: {e:?}")))?;
        Ok(())
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
