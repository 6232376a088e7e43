//! vCPUs: one thread each, owning its `VcpuFd`. The VM controls a thread
//! through [`VcpuHandle`]: run, park, run a job on the thread while parked
//! (state save/restore), kick out of the idle port, exit.
//!
//! Parking is race-free: the thread clears `immediate_exit` before it checks
//! its orders, and the kick signal's handler sets it, so a kick that lands
//! anywhere between that check and `KVM_RUN` makes `KVM_RUN` return at once.
//! Before parking, the thread re-enters KVM with `immediate_exit` set so that
//! a pending port or MMIO access completes and the saved state is consistent.

use std::cell::Cell;
use std::os::unix::thread::JoinHandleExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_bindings::{
    kvm_cpuid_entry2, kvm_debugregs, kvm_lapic_state, kvm_mp_state, kvm_msr_entry, kvm_regs,
    kvm_run, kvm_sregs, kvm_vcpu_events, kvm_xcrs, CpuId, Xsave,
};
use kvm_ioctls::{VcpuExit, VcpuFd};
use vmm_sys_util::signal::{register_signal_handler, SIGRTMIN};

use crate::arch;
use crate::devices::{Devices, GuestExit, PioAction};
use crate::error::{Error, Result};

/// Everything KVM holds about one vCPU, in save order.
#[derive(Clone)]
pub struct VcpuState {
    pub cpuid: Vec<kvm_cpuid_entry2>,
    pub mp_state: kvm_mp_state,
    pub regs: kvm_regs,
    pub sregs: kvm_sregs,
    /// The XSAVE area as 32-bit words (KVM_GET_XSAVE2's size).
    pub xsave: Vec<u32>,
    pub xcrs: kvm_xcrs,
    pub debugregs: kvm_debugregs,
    pub lapic: kvm_lapic_state,
    pub msrs: Vec<kvm_msr_entry>,
    pub events: kvm_vcpu_events,
    pub tsc_khz: u32,
}

fn kvm_err(op: &'static str) -> impl Fn(kvm_ioctls::Error) -> Error {
    move |e| Error::kvm(op, e)
}

/// The words of the legacy XSAVE area and its header (`struct kvm_xsave`):
/// the least any KVM reads or writes, and so the least a saved area holds.
pub const XSAVE_MIN_WORDS: usize = 1024;

fn xsave_buffer(words: usize) -> Result<Xsave> {
    Xsave::new(words.saturating_sub(XSAVE_MIN_WORDS))
        .map_err(|e| Error::Config(format!("XSAVE buffer of {words} words: {e:?}")))
}

/// The buffer `KVM_SET_XSAVE` gets for the saved area `saved`: exactly
/// `words` long (KVM's size for this VM, `KVM_CAP_XSAVE2`), since KVM reads
/// that many whatever the buffer holds. A shorter saved area (from a host
/// with fewer state components) is padded with zeros, which its header's
/// `XSTATE_BV` leaves unread; an area shorter than the legacy one, or longer
/// than KVM's, is refused.
fn xsave_area(saved: &[u32], words: usize) -> Result<Xsave> {
    if saved.len() < XSAVE_MIN_WORDS || saved.len() > words {
        return Err(Error::Config(format!(
            "an XSAVE area of {} bytes cannot be restored: KVM takes {} bytes here, and no area is shorter than {} bytes",
            saved.len() * 4,
            words * 4,
            XSAVE_MIN_WORDS * 4
        )));
    }
    let mut xs = xsave_buffer(words)?;
    let (region, extra) = saved.split_at(XSAVE_MIN_WORDS);
    // SAFETY: region is the FAM struct's fixed part, XSAVE_MIN_WORDS long.
    unsafe { xs.as_mut_fam_struct() }
        .xsave
        .region
        .copy_from_slice(region);
    xs.as_mut_slice()[..extra.len()].copy_from_slice(extra);
    Ok(xs)
}

/// Saves a parked vCPU's state (Firecracker's order: MP state first, events
/// last, since the other reads may change pending events).
pub fn save_state(fd: &VcpuFd, msr_indices: &[u32], xsave_words: usize) -> Result<VcpuState> {
    let cpuid = fd
        .get_cpuid2(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
        .map_err(kvm_err("KVM_GET_CPUID2"))?
        .as_slice()
        .to_vec();
    let mp_state = fd.get_mp_state().map_err(kvm_err("KVM_GET_MP_STATE"))?;
    let regs = fd.get_regs().map_err(kvm_err("KVM_GET_REGS"))?;
    let sregs = fd.get_sregs().map_err(kvm_err("KVM_GET_SREGS"))?;
    let mut xs = xsave_buffer(xsave_words)?;
    // SAFETY: the buffer is sized from KVM_CAP_XSAVE2 for this VM.
    unsafe { fd.get_xsave2(&mut xs) }.map_err(kvm_err("KVM_GET_XSAVE2"))?;
    let mut xsave = xs.as_fam_struct_ref().xsave.region.to_vec();
    xsave.extend_from_slice(xs.as_slice());
    let xcrs = fd.get_xcrs().map_err(kvm_err("KVM_GET_XCRS"))?;
    let debugregs = fd.get_debug_regs().map_err(kvm_err("KVM_GET_DEBUGREGS"))?;
    let lapic = fd.get_lapic().map_err(kvm_err("KVM_GET_LAPIC"))?;
    let msrs = arch::get_msrs(fd, msr_indices)?;
    let tsc_khz = fd.get_tsc_khz().unwrap_or(0);
    let events = fd
        .get_vcpu_events()
        .map_err(kvm_err("KVM_GET_VCPU_EVENTS"))?;
    Ok(VcpuState {
        cpuid,
        mp_state,
        regs,
        sregs,
        xsave,
        xcrs,
        debugregs,
        lapic,
        msrs,
        events,
        tsc_khz,
    })
}

/// Loads a vCPU's state. `set_cpuid` is false for rollback: KVM refuses to
/// change CPUID once a vCPU has run, and rollback checks it is unchanged.
/// `xsave_words` is KVM's XSAVE size for this VM, as for [`save_state`].
pub fn restore_state(
    fd: &VcpuFd,
    s: &VcpuState,
    set_cpuid: bool,
    xsave_words: usize,
) -> Result<()> {
    if set_cpuid {
        let cpuid =
            CpuId::from_entries(&s.cpuid).map_err(|e| Error::Config(format!("CPUID: {e:?}")))?;
        fd.set_cpuid2(&cpuid).map_err(kvm_err("KVM_SET_CPUID2"))?;
        if s.tsc_khz != 0 && fd.get_tsc_khz().ok() != Some(s.tsc_khz) {
            if let Err(e) = fd.set_tsc_khz(s.tsc_khz) {
                tracing::warn!(
                    "cannot scale the TSC to the snapshot's {} kHz: {e}",
                    s.tsc_khz
                );
            }
        }
    }
    fd.set_mp_state(s.mp_state)
        .map_err(kvm_err("KVM_SET_MP_STATE"))?;
    fd.set_regs(&s.regs).map_err(kvm_err("KVM_SET_REGS"))?;
    fd.set_sregs(&s.sregs).map_err(kvm_err("KVM_SET_SREGS"))?;
    let xs = xsave_area(&s.xsave, xsave_words)?;
    // SAFETY: the buffer is xsave_words long, the size KVM reported.
    unsafe { fd.set_xsave2(&xs) }.map_err(kvm_err("KVM_SET_XSAVE2"))?;
    fd.set_xcrs(&s.xcrs).map_err(kvm_err("KVM_SET_XCRS"))?;
    fd.set_debug_regs(&s.debugregs)
        .map_err(kvm_err("KVM_SET_DEBUGREGS"))?;
    fd.set_lapic(&s.lapic).map_err(kvm_err("KVM_SET_LAPIC"))?;
    let mut msrs = s.msrs.clone();
    arch::order_msrs(&mut msrs);
    arch::set_msrs(fd, &msrs)?;
    fd.set_vcpu_events(&s.events)
        .map_err(kvm_err("KVM_SET_VCPU_EVENTS"))?;
    Ok(())
}

/// The signal that kicks a vCPU thread out of `KVM_RUN`.
fn kick_signal() -> i32 {
    SIGRTMIN()
}

thread_local! {
    static KVM_RUN: Cell<*mut kvm_run> = const { Cell::new(std::ptr::null_mut()) };
}

extern "C" fn on_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    let run = KVM_RUN.with(|r| r.get());
    if !run.is_null() {
        // SAFETY: points at this thread's mmap'ed kvm_run, alive while the
        // thread runs; a volatile byte store is async-signal-safe.
        unsafe { std::ptr::addr_of_mut!((*run).immediate_exit).write_volatile(1) };
    }
}

fn install_kick_handler() -> Result<()> {
    static INSTALLED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    INSTALLED
        .get_or_init(|| register_signal_handler(kick_signal(), on_kick).map_err(|e| e.to_string()))
        .clone()
        .map_err(|e| Error::Config(format!("installing the vCPU kick handler: {e}")))
}

/// What the VM wants a vCPU thread to do.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Order {
    Run,
    Park,
    Exit,
}

type Job = Box<dyn FnOnce(&mut VcpuFd) + Send>;

struct Ctl {
    order: Order,
    parked: bool,
    job: Option<Job>,
    kicked: bool,
}

struct Shared {
    ctl: Mutex<Ctl>,
    cv: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Ctl> {
        self.ctl.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Counters a vCPU keeps.
#[derive(Default)]
pub struct VcpuCounters {
    /// VM exits handled in user space.
    pub exits: AtomicU64,
}

/// The VM's handle on one vCPU thread.
pub struct VcpuHandle {
    index: usize,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    counters: Arc<VcpuCounters>,
}

/// How long a vCPU thread may take to park: a pause that waits longer for
/// one (a vCPU busy in a device's host I/O, such as a guest's flush on a
/// slow disk) is withdrawn.
pub const PARK_TIMEOUT: Duration = Duration::from_secs(5);

impl VcpuHandle {
    /// Starts a parked thread for `fd`.
    pub fn spawn(index: usize, fd: VcpuFd, devices: Arc<Devices>) -> Result<VcpuHandle> {
        install_kick_handler()?;
        let shared = Arc::new(Shared {
            ctl: Mutex::new(Ctl {
                order: Order::Park,
                parked: false,
                job: None,
                kicked: false,
            }),
            cv: Condvar::new(),
        });
        let counters = Arc::new(VcpuCounters::default());
        let (s, c) = (shared.clone(), counters.clone());
        let thread = std::thread::Builder::new()
            .name(format!("twig-vcpu{index}"))
            .stack_size(256 * 1024)
            .spawn(move || {
                crate::jail::seccomp::thread_start(crate::jail::seccomp::Role::Vcpu);
                vcpu_loop(fd, s, devices, c)
            })
            .map_err(|e| Error::io(format!("spawning vCPU {index} thread"), e))?;
        let h = VcpuHandle {
            index,
            shared,
            thread: Some(thread),
            counters,
        };
        if !h.wait_parked(Instant::now() + PARK_TIMEOUT) {
            return Err(Error::Vcpu {
                index,
                reason: format!("its thread did not start within {PARK_TIMEOUT:?}"),
            });
        }
        Ok(h)
    }

    /// Exit counters.
    pub fn counters(&self) -> &VcpuCounters {
        &self.counters
    }

    fn signal(&self) {
        if let Some(t) = &self.thread {
            // SAFETY: the thread is alive until joined in Drop.
            unsafe { libc::pthread_kill(t.as_pthread_t(), kick_signal()) };
        }
    }

    /// Asks the thread to park (without waiting). Returns whether it was
    /// told to run until now, i.e. whether this request stops it.
    pub fn request_park(&self) -> bool {
        let mut c = self.shared.lock();
        let stops = c.order == Order::Run;
        if stops {
            c.order = Order::Park;
        }
        self.shared.cv.notify_all();
        drop(c);
        self.signal();
        stops
    }

    /// Waits until the thread is parked, or `deadline` passes; returns
    /// whether it parked.
    pub fn wait_parked(&self, deadline: Instant) -> bool {
        let c = self.shared.lock();
        let left = deadline.saturating_duration_since(Instant::now());
        let (guard, _) = self
            .shared
            .cv
            .wait_timeout_while(c, left, |c| !c.parked)
            .unwrap_or_else(|p| p.into_inner());
        guard.parked
    }

    /// Lets a parked thread run the guest.
    pub fn run(&self) {
        let mut c = self.shared.lock();
        c.order = Order::Run;
        self.shared.cv.notify_all();
    }

    /// Wakes the guest if it waits on the idle port (or when it next does).
    pub fn kick(&self) {
        let mut c = self.shared.lock();
        c.kicked = true;
        self.shared.cv.notify_all();
    }

    /// Runs `f` on the parked thread and returns its result.
    pub fn exec<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut VcpuFd) -> R + Send + 'static,
    ) -> Result<R> {
        let rx = self.submit(f)?;
        job_result(self.index, &rx)
    }

    /// Queues `f` on the parked thread; the receiver yields its result.
    pub fn submit<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut VcpuFd) -> R + Send + 'static,
    ) -> Result<mpsc::Receiver<R>> {
        let (tx, rx) = mpsc::sync_channel(1);
        let mut c = self.shared.lock();
        if !c.parked || c.job.is_some() {
            return Err(Error::Vcpu {
                index: self.index,
                reason: "not parked".into(),
            });
        }
        c.job = Some(Box::new(move |fd: &mut VcpuFd| {
            let _ = tx.send(f(fd));
        }));
        self.shared.cv.notify_all();
        Ok(rx)
    }
}

/// How long a job on a parked vCPU thread may take.
const JOB_TIMEOUT: Duration = Duration::from_secs(10);

/// Waits for a job queued with [`VcpuHandle::submit`] on vCPU `index`.
pub fn job_result<R>(index: usize, rx: &mpsc::Receiver<R>) -> Result<R> {
    rx.recv_timeout(JOB_TIMEOUT).map_err(|e| Error::Vcpu {
        index,
        reason: match e {
            mpsc::RecvTimeoutError::Timeout => {
                format!("a state operation did not finish within {JOB_TIMEOUT:?}")
            }
            mpsc::RecvTimeoutError::Disconnected => "vCPU thread exited".into(),
        },
    })
}

impl Drop for VcpuHandle {
    fn drop(&mut self) {
        {
            let mut c = self.shared.lock();
            c.order = Order::Exit;
            self.shared.cv.notify_all();
        }
        self.signal();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn set_immediate_exit(fd: &mut VcpuFd, v: u8) {
    fd.set_kvm_immediate_exit(v);
}

fn park(fd: &mut VcpuFd, shared: &Shared, has_run: &mut bool) -> bool {
    if *has_run {
        // Complete any pending I/O so that the state we expose is consistent.
        set_immediate_exit(fd, 1);
        let _ = fd.run();
        set_immediate_exit(fd, 0);
        *has_run = false;
    }
    let mut c = shared.lock();
    c.parked = true;
    shared.cv.notify_all();
    loop {
        if let Some(job) = c.job.take() {
            drop(c);
            job(fd);
            c = shared.lock();
            continue;
        }
        match c.order {
            Order::Exit => return false,
            Order::Run => {
                c.parked = false;
                return true;
            }
            Order::Park => c = shared.cv.wait(c).unwrap_or_else(|p| p.into_inner()),
        }
    }
}

fn idle(shared: &Shared) {
    let mut c = shared.lock();
    while !c.kicked && c.order == Order::Run {
        c = shared.cv.wait(c).unwrap_or_else(|p| p.into_inner());
    }
    c.kicked = false;
}

fn vcpu_loop(
    mut fd: VcpuFd,
    shared: Arc<Shared>,
    devices: Arc<Devices>,
    counters: Arc<VcpuCounters>,
) {
    let run_ptr: *mut kvm_run = fd.get_kvm_run();
    KVM_RUN.with(|r| r.set(run_ptr));
    let mut has_run = false;
    loop {
        set_immediate_exit(&mut fd, 0);
        let order = shared.lock().order;
        if order != Order::Run {
            if !park(&mut fd, &shared, &mut has_run) {
                break;
            }
            continue;
        }
        has_run = true;
        let exit = match fd.run() {
            Ok(exit) => exit,
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => continue,
            Err(e) => {
                devices
                    .exit()
                    .set(GuestExit::Failed(format!("KVM_RUN: {e}")));
                shared.lock().order = Order::Park;
                continue;
            }
        };
        counters.exits.fetch_add(1, Ordering::Relaxed);
        let stop = match exit {
            VcpuExit::IoOut(port, data) => {
                if devices.pio_write(port, data) == PioAction::Idle {
                    idle(&shared);
                }
                None
            }
            VcpuExit::IoIn(port, data) => {
                devices.pio_read(port, data);
                None
            }
            VcpuExit::MmioRead(addr, data) => {
                devices.mmio_read(addr, data);
                None
            }
            VcpuExit::MmioWrite(addr, data) => {
                devices.mmio_write(addr, data);
                None
            }
            VcpuExit::Hlt => None,
            VcpuExit::Shutdown => Some(GuestExit::TripleFault),
            VcpuExit::SystemEvent(kind, _) => Some(GuestExit::SystemEvent(kind)),
            other => Some(GuestExit::Failed(format!("unhandled VM exit {other:?}"))),
        };
        let stop = stop.or_else(|| devices.exit().get());
        if let Some(e) = stop {
            devices.exit().set(e);
            let mut c = shared.lock();
            if c.order == Order::Run {
                c.order = Order::Park;
            }
        }
    }
    KVM_RUN.with(|r| r.set(std::ptr::null_mut()));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_xsave_area_is_handed_to_kvm_at_exactly_its_size() {
        let words = XSAVE_MIN_WORDS + 1728;
        let e = xsave_area(&[7; 100], words).err().unwrap().to_string();
        assert!(
            e.contains("400 bytes cannot be restored") && e.contains("shorter than 4096"),
            "{e}"
        );
        let e = xsave_area(&vec![7; words + 1], words)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains(&format!("KVM takes {} bytes", words * 4)), "{e}");
        let saved: Vec<u32> = (0..XSAVE_MIN_WORDS as u32 + 10).collect();
        let xs = xsave_area(&saved, words).unwrap();
        assert_eq!(
            xs.as_fam_struct_ref().xsave.region[..],
            saved[..XSAVE_MIN_WORDS]
        );
        assert_eq!(xs.as_slice().len(), words - XSAVE_MIN_WORDS, "KVM's size");
        assert_eq!(xs.as_slice()[..10], saved[XSAVE_MIN_WORDS..]);
        assert!(xs.as_slice()[10..].iter().all(|w| *w == 0), "zero-padded");
    }
}
