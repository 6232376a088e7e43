//! The ring-3 test guest (guests/testguest.S), assembled at build time, and
//! its mailbox protocol. Tests and the benchmark drive it; see the assembly
//! source for what each command does.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::vm::Vm;

/// The guest as an ELF vmlinux-style image, loaded at 1 MiB.
pub const ELF: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/testguest.elf"));

/// The same guest as a bzImage (64-bit entry 0x200 past its load address).
pub const BZIMAGE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/testguest.bzImage"));

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

/// Mailbox commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
pub enum Command {
    /// Print a byte on COM1.
    Print = 1,
    /// Write `value + i` into the first word of pages `i` in `0..count` from a GPA.
    Dirty = 2,
    /// Increment [`COUNTER`] until the command changes.
    Spin = 3,
    /// Reset through the i8042.
    Stop = 4,
    /// Execute `ud2` with no IDT: a triple fault.
    Crash = 5,
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
