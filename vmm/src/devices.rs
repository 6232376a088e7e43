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

/// The VM's port-I/O devices.
pub struct Devices {
    serial: Mutex<Uart>,
    i8042: Mutex<I8042Device<ResetTrigger>>,
    exit: Arc<ExitState>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Devices {
    /// Creates the devices; `irq` is the eventfd registered for COM1's IRQ.
    pub fn new(out: SerialOut, irq: EventFd, exit: Arc<ExitState>) -> Devices {
        Devices {
            serial: Mutex::new(Serial::new(IrqTrigger(irq), out)),
            i8042: Mutex::new(I8042Device::new(ResetTrigger(exit.clone()))),
            exit,
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

    /// Device state for a snapshot.
    pub fn save(&self) -> Vec<u8> {
        let s = lock(&self.serial).state();
        let mut out = vec![
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
        out.extend_from_slice(&(s.in_buffer.len() as u32).to_le_bytes());
        out.extend_from_slice(&s.in_buffer);
        out
    }

    /// Parses device state saved by [`Devices::save`] without applying it.
    pub fn parse(state: &[u8]) -> Result<SerialState> {
        let bad = || {
            Error::Config(format!(
                "serial state of {} bytes is malformed",
                state.len()
            ))
        };
        if state.len() < 13 {
            return Err(bad());
        }
        let n = u32::from_le_bytes([state[9], state[10], state[11], state[12]]) as usize;
        if state.len() != 13 + n || n > 64 {
            return Err(bad());
        }
        Ok(SerialState {
            baud_divisor_low: state[0],
            baud_divisor_high: state[1],
            interrupt_enable: state[2],
            interrupt_identification: state[3],
            line_control: state[4],
            line_status: state[5],
            modem_control: state[6],
            modem_status: state[7],
            scratch: state[8],
            in_buffer: state[13..].to_vec(),
        })
    }

    /// Applies parsed device state.
    pub fn restore(&self, state: &SerialState) -> Result<()> {
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
        *serial = Serial::from_state(state, IrqTrigger(irq), NoEvents, out)
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
