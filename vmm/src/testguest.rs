//! The ring-3 test guest (guests/testguest.S), assembled at build time, and
//! its mailbox protocol. Tests and the benchmark drive it; see the assembly
//! source for what each command does.
//!
//! It enters through the 64-bit boot protocol and drops to ring 3 (this
//! machine's KVM emulates ring 0 ~4,000× slower), then obeys commands in a
//! memory mailbox: print, dirty N pages, spin, stop, crash, and churn
//! (check and rewrite a self-describing pattern over N pages, generation
//! after generation, counting pages that did not hold it; optionally
//! driving a virtio-net receive queue so the device thread writes guest
//! memory meanwhile). With no command it waits at the idle port, at
//! [`PARKED_RIP`], so tests comparing two looks at the vCPU stop it at the
//! same place. Behind the cargo feature `testguest`: a production build
//! neither contains it nor needs binutils.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::vm::Vm;

/// The guest as an ELF vmlinux-style image, loaded at 1 MiB.
pub const ELF: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/testguest.elf"));

/// The same guest as a bzImage (64-bit entry 0x200 past its load address).
pub const BZIMAGE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/testguest.bzImage"));

/// Guest physical address of the MMIO window of virtio device `index` (in
/// the VM's fixed device order: rng, disks, disk slots, net, vsock,
/// balloon).
pub fn virtio_mmio_addr(index: usize) -> u64 {
    crate::virtio::MMIO_BASE + index as u64 * crate::virtio::MMIO_SIZE
}

// `PARKED_RIP`, the guest's RIP while its vCPU waits at the idle port (in
// the ELF image), as the build script read it from the guest's symbols.
include!(concat!(env!("OUT_DIR"), "/testguest_parked.rs"));

/// Guest physical address of the mailbox.
pub const MAILBOX: u64 = 0x18_0000;
const CMD: u64 = MAILBOX;
const ARG0: u64 = MAILBOX + 0x08;
const ARG1: u64 = MAILBOX + 0x10;
const ARG2: u64 = MAILBOX + 0x18;
/// Completed-command counter.
pub const DONE: u64 = MAILBOX + 0x20;
/// The spin command's counter.
pub const COUNTER: u64 = MAILBOX + 0x28;
/// Written at boot: "twig" then 1.
pub const MAGIC: u64 = MAILBOX + 0x30;
/// The value at [`MAGIC`] once the guest has booted.
pub const MAGIC_VALUE: u64 = 0x0000_0001_6769_7774;
/// First page the dirty command may use (16 MiB; below is the guest itself).
pub const SCRATCH: u64 = 16 << 20;

/// Churn: the generation of the pages not yet rewritten in the current pass
/// (read by the guest when churn starts).
pub const CHURN_GEN: u64 = MAILBOX + 0x38;
/// Churn: the page being checked (index in the range).
pub const CHURN_CURSOR: u64 = MAILBOX + 0x40;
/// Churn: pages checked.
pub const CHURN_VERIFIED: u64 = MAILBOX + 0x48;
/// Churn: pages that did not hold their pattern.
pub const CHURN_BAD: u64 = MAILBOX + 0x50;
/// Churn: the first bad page (index in the range).
pub const CHURN_BAD_PAGE: u64 = MAILBOX + 0x58;
/// Churn: the first bad page's first wrong word (index in the page).
pub const CHURN_BAD_WORD: u64 = MAILBOX + 0x60;
/// Churn: the value the guest found in that word.
pub const CHURN_BAD_SEEN: u64 = MAILBOX + 0x68;
/// Churn: network frames the guest received.
pub const CHURN_RX: u64 = MAILBOX + 0x70;
/// A mailbox word the guest never touches, free for the host (a marker
/// that shows which snapshot guest memory came from).
pub const HOST_TAG: u64 = MAILBOX + 0x78;
/// Where tests put the churn command's network queue area (8 MiB: above
/// the guest, its mailbox and stack, below [`SCRATCH`]).
pub const NET_QUEUE_AREA: u64 = 8 << 20;
/// The multiplier of the churn pattern.
const CHURN_K: u64 = 0x9e37_79b9_7f4a_7c15;
/// 64-bit words in a page.
pub const PAGE_WORDS: usize = 512;

/// Mailbox commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
pub enum Command {
    /// Print byte `arg0` on COM1 `arg1` times (0: once).
    Print = 1,
    /// Write `value + i` into the first word of pages `i` in `0..count` from a GPA.
    Dirty = 2,
    /// Increment [`COUNTER`] until the command changes.
    Spin = 3,
    /// Reset through the i8042.
    Stop = 4,
    /// Execute `ud2` with no IDT: a triple fault.
    Crash = 5,
    /// Check and rewrite a self-describing pattern over `count` pages from
    /// a GPA, generation after generation, until the command changes;
    /// with a queue area (see [`prepare_net_rx`]), also keep a virtio-net
    /// receive queue supplied with buffers.
    Churn = 6,
}

/// Word `word` of churn page `page` in generation `gen`.
pub fn churn_word(page: u64, gen: u64, word: usize) -> u64 {
    if word == 0 {
        gen
    } else {
        gen.wrapping_mul(CHURN_K) ^ (page << 9) ^ word as u64
    }
}

/// The churn command's counters, as the guest keeps them in the mailbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChurnStatus {
    /// Generation of the pages not yet rewritten in the current pass.
    pub gen: u64,
    /// The page being checked.
    pub cursor: u64,
    /// Pages checked.
    pub verified: u64,
    /// Pages that did not hold their pattern.
    pub bad: u64,
    /// The first bad page.
    pub bad_page: u64,
    /// Its first wrong word.
    pub bad_word: u64,
    /// The value found there.
    pub bad_seen: u64,
    /// Network frames received.
    pub rx: u64,
}

impl ChurnStatus {
    /// Reads the counters (pause the VM for a consistent set).
    pub fn read(vm: &Vm) -> Result<ChurnStatus> {
        Ok(ChurnStatus {
            gen: vm.read_u64(CHURN_GEN)?,
            cursor: vm.read_u64(CHURN_CURSOR)?,
            verified: vm.read_u64(CHURN_VERIFIED)?,
            bad: vm.read_u64(CHURN_BAD)?,
            bad_page: vm.read_u64(CHURN_BAD_PAGE)?,
            bad_word: vm.read_u64(CHURN_BAD_WORD)?,
            bad_seen: vm.read_u64(CHURN_BAD_SEEN)?,
            rx: vm.read_u64(CHURN_RX)?,
        })
    }
}

/// A page of a churn range that does not hold what the guest's registers
/// say it should.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChurnMismatch {
    /// The page (index in the range).
    pub page: u64,
    /// The first wrong word.
    pub word: usize,
    /// The generation the page should hold.
    pub want_gen: u64,
    /// The value found.
    pub seen: u64,
}

/// Checks a paused, churning VM's range of `pages` pages from `first`
/// against vCPU 0's registers (generation in `r10`, cursor in `r11`): pages
/// below the cursor must hold the next generation, pages above it the
/// current one; the page at the cursor may be half rewritten and is
/// skipped. Returns every page that differs.
pub fn churn_check(vm: &Vm, first: u64, pages: u64) -> Result<Vec<ChurnMismatch>> {
    let regs = vm.vcpu_regs(0)?;
    let (gen, cursor) = (regs.r10, regs.r11);
    let mut bad = Vec::new();
    let mut buf = vec![0u8; PAGE_WORDS * 8];
    for page in (0..pages).filter(|p| *p != cursor) {
        let want_gen = if page < cursor { gen + 1 } else { gen };
        vm.read_guest(first + page * 4096, &mut buf)?;
        let wrong = buf.chunks_exact(8).enumerate().find_map(|(word, b)| {
            let mut w = [0u8; 8];
            w.copy_from_slice(b);
            let seen = u64::from_le_bytes(w);
            (seen != churn_word(page, want_gen, word)).then_some((word, seen))
        });
        if let Some((word, seen)) = wrong {
            bad.push(ChurnMismatch {
                page,
                word,
                want_gen,
                seen,
            });
        }
    }
    Ok(bad)
}

/// Size of one receive buffer in a churn queue area.
pub const NET_RX_BUF: u32 = 2048;

/// Lays out a virtio-net receive queue of `size` buffers at `area` for the
/// churn command (see guests/testguest.S): the device's MMIO base and the
/// queue size, a descriptor table of device-writable buffers, an available
/// ring listing them in order (interrupts suppressed: the guest polls the
/// used ring) and an empty used ring.
pub fn prepare_net_rx(vm: &Vm, area: u64, mmio_base: u64, size: u16) -> Result<()> {
    if !size.is_power_of_two() || size > 256 {
        return Err(Error::Config(format!(
            "queue size {size} is not a power of two up to 256"
        )));
    }
    let buffers = area + 0x4000;
    let mut head = Vec::with_capacity(16);
    head.extend_from_slice(&mmio_base.to_le_bytes());
    head.extend_from_slice(&u64::from(size).to_le_bytes());
    vm.write_guest(area, &head)?;
    let mut desc = Vec::with_capacity(usize::from(size) * 16);
    let mut avail = vec![1u8, 0, 0, 0]; // VIRTQ_AVAIL_F_NO_INTERRUPT, idx 0
    for i in 0..size {
        let addr = buffers + u64::from(i) * u64::from(NET_RX_BUF);
        desc.extend_from_slice(&addr.to_le_bytes());
        desc.extend_from_slice(&NET_RX_BUF.to_le_bytes());
        desc.extend_from_slice(&2u16.to_le_bytes()); // VIRTQ_DESC_F_WRITE
        desc.extend_from_slice(&0u16.to_le_bytes());
        avail.extend_from_slice(&i.to_le_bytes());
    }
    avail.extend_from_slice(&0u16.to_le_bytes());
    vm.write_guest(area + 0x1000, &desc)?;
    vm.write_guest(area + 0x2000, &avail)?;
    vm.write_guest(area + 0x3000, &vec![0u8; 4 + 8 * usize::from(size) + 2])
}

/// Writes the ELF guest image into `dir` and returns its path.
pub fn write_to(dir: &Path) -> Result<PathBuf> {
    write_image(dir, "testguest.elf", ELF)
}

/// Writes `image` as `dir/name` and returns its path.
pub fn write_image(dir: &Path, name: &str, image: &[u8]) -> Result<PathBuf> {
    let path = dir.join(name);
    std::fs::write(&path, image)
        .map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
    Ok(path)
}

/// How long [`post`] waits for the previous command to finish.
const POST_TIMEOUT: Duration = Duration::from_secs(10);

/// Posts a command and kicks the guest; returns the completion count to
/// wait for. Waits first for the previous command to finish (the guest
/// counts a command in [`DONE`] before it clears `cmd`), so that no command
/// is overwritten and no completion is mistaken for another's.
pub fn post(vm: &mut Vm, cmd: Command, args: [u64; 3]) -> Result<u64> {
    poll(POST_TIMEOUT, "the previous command to finish", || {
        Ok(vm.read_u64(CMD)? == 0)
    })?;
    let done = vm.read_u64(DONE)?;
    vm.write_u64(ARG0, args[0])?;
    vm.write_u64(ARG1, args[1])?;
    vm.write_u64(ARG2, args[2])?;
    vm.write_u64(CMD, cmd as u64)?;
    vm.kick();
    Ok(done + 1)
}

/// Polls `f` until it returns true or `timeout` passes.
pub fn poll(timeout: Duration, what: &str, mut f: impl FnMut() -> Result<bool>) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if f()? {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(Error::Config(format!(
                "timed out after {timeout:?} waiting for {what}"
            )));
        }
        std::thread::yield_now();
    }
}

/// Runs a command to completion.
pub fn run(vm: &mut Vm, cmd: Command, args: [u64; 3], timeout: Duration) -> Result<()> {
    let want = post(vm, cmd, args)?;
    poll(timeout, &format!("{cmd:?} to complete"), || {
        Ok(vm.read_u64(DONE)? >= want)
    })
}

/// Waits until the guest has booted (its magic is in the mailbox).
pub fn wait_booted(vm: &Vm, timeout: Duration) -> Result<()> {
    poll(timeout, "the test guest to boot", || {
        Ok(vm.read_u64(MAGIC)? == MAGIC_VALUE)
    })
}
