//! Attaching a program to the ingress of an interface, as a TCX link or as a
//! netlink tc filter, and removing a netlink filter again. Runs in the pod's
//! namespace.
//!
//! - **TCX** (Linux 6.6+, when asked for): two TCX links, pinned as
//!   `link_tap`/`link_veth`; owned by their pins, so no other tc user can
//!   replace them. Detach unpins them. Each link create waits for an RCU
//!   grace period (~25 ms here), so the two attaches run on two threads.
//! - **Netlink** (the default: any kernel, ~0.25 ms a pod): a `clsact` qdisc
//!   is added unless the interface has one, then a direct-action `bpf`
//!   filter with a priority and handle the kernel chooses. A filter is not
//!   a BPF link, so what a restarted process needs is recorded: the programs
//!   are pinned (`prog_tap`, `prog_veth`), the `attachment` map holds both
//!   ifindexes, priorities and handles and the namespace's identity
//!   (`st_dev`, `st_ino`), and a bpffs symlink `netns` holds the namespace
//!   file's path. Detach deletes exactly those two filters, in that
//!   namespace, only if the file still names the same namespace (if it is
//!   gone, its filters went with it); other filters and the `clsact` qdisc
//!   are left alone. An interface that goes while its filter is deleted
//!   (`ENODEV`, or the index names another) took its filter with it: CNI
//!   deletes the veth while a dead shim's pod is cleaned up. Any other
//!   failure keeps the pins, so a detach can be retried, and names the
//!   errno (aya's message names only the kernel's extended ack).

use std::path::Path;

use aya::programs::links::{FdLink, Link, LinkOrder};
use aya::programs::tc::{qdisc_add_clsact, NlOptions, SchedClassifierLink, TcAttachOptions};
use aya::programs::{SchedClassifier, TcAttachType, TcError, TcHandle};
use aya::Ebpf;

use crate::error::Context;
use crate::support::AttachMode;
use crate::Error;

/// What an attach left in place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Attached {
    /// A TCX link, pinned (its pin keeps it attached).
    Tcx,
    /// A direct-action filter on the interface's `clsact` qdisc.
    Filter {
        /// The filter's priority (chosen by the kernel).
        prio: u16,
        /// The filter's handle (chosen by the kernel).
        handle: u32,
    },
}

/// The loaded classifier `name` of `ebpf`.
pub(crate) fn program<'a>(
    ebpf: &'a mut Ebpf,
    name: &'static str,
) -> Result<&'a mut SchedClassifier, Error> {
    ebpf.program_mut(name)
        .ok_or_else(|| Error::Bpf {
            what: format!("the embedded object has no program {name}"),
            source: "missing".into(),
        })?
        .try_into()
        .context(|| format!("program {name} is not a tc classifier"))
}

/// The two classifiers of `ebpf`, `first` and `second`, borrowed together
/// (to attach them from two threads).
pub(crate) fn two_programs<'a>(
    ebpf: &'a mut Ebpf,
    first: &'static str,
    second: &'static str,
) -> Result<(&'a mut SchedClassifier, &'a mut SchedClassifier), Error> {
    let (mut a, mut b) = (None, None);
    for (name, program) in ebpf.programs_mut() {
        if name == first {
            a = Some(program);
        } else if name == second {
            b = Some(program);
        }
    }
    let classifier = |program: Option<&'a mut aya::programs::Program>, name: &'static str| {
        program
            .ok_or_else(|| Error::Bpf {
                what: format!("the embedded object has no program {name}"),
                source: "missing".into(),
            })?
            .try_into()
            .context(|| format!("program {name} is not a tc classifier"))
    };
    Ok((classifier(a, first)?, classifier(b, second)?))
}

/// Attaches `program` (named `name`) to the ingress of `interface`. In TCX
/// mode the link is pinned at `link_pin`; in netlink mode a `clsact` qdisc is
/// added unless the interface has one, then a filter whose priority and
/// handle are returned (the caller records them).
pub(crate) fn attach(
    program: &mut SchedClassifier,
    name: &'static str,
    interface: &str,
    mode: AttachMode,
    link_pin: &Path,
) -> Result<Attached, Error> {
    match mode {
        AttachMode::Tcx => {
            let link_id = program
                .attach_with_options(
                    interface,
                    TcAttachType::Ingress,
                    TcAttachOptions::TcxOrder(LinkOrder::default()),
                )
                .context(|| format!("attaching {name} to the ingress of {interface} (TCX)"))?;
            let link = program
                .take_link(link_id)
                .context(|| format!("taking the link of {name}"))?;
            let link: FdLink = link
                .try_into()
                .context(|| format!("the link of {name} is not a BPF link"))?;
            link.pin(link_pin)
                .context(|| format!("pinning the link of {name} at {}", link_pin.display()))?;
            Ok(Attached::Tcx)
        }
        AttachMode::Netlink => {
            match qdisc_add_clsact(interface) {
                Ok(()) => {}
                Err(TcError::NetlinkError(e)) if e.raw_os_error() == Some(libc::EEXIST) => {}
                Err(e) => {
                    return Err(e).context(|| format!("adding a clsact qdisc to {interface}"))
                }
            }
            let link_id = program
                .attach_with_options(
                    interface,
                    TcAttachType::Ingress,
                    TcAttachOptions::Netlink(NlOptions::default()),
                )
                .context(|| {
                    format!("attaching {name} to the ingress of {interface} (tc filter)")
                })?;
            let link = program
                .take_link(link_id)
                .context(|| format!("taking the filter of {name}"))?;
            let attached = Attached::Filter {
                prio: link.priority().context(|| "the filter's priority".into())?,
                handle: link
                    .handle()
                    .context(|| "the filter's handle".into())?
                    .into(),
            };
            // Dropping the link would delete the filter: the filter now
            // belongs to the pod's record (priority and handle, written by the
            // caller), not to this process. The link holds no descriptor.
            std::mem::forget(link);
            Ok(attached)
        }
    }
}

/// Deletes the ingress filter (`prio`, `handle`) of `interface`. A filter
/// that is already gone is not an error, and neither is an interface that
/// goes while its filter is deleted: CNI deletes the pod's veth (and the
/// runtime the tap) while a dead shim's pod is cleaned up.
pub(crate) fn detach_filter(interface: &str, prio: u16, handle: u32) -> Result<(), Error> {
    find_filter(interface, prio, handle)?.delete()
}

/// The ingress filter (`prio`, `handle`) of `interface`, found by the
/// interface's index as it is now.
fn find_filter(interface: &str, prio: u16, handle: u32) -> Result<Filter, Error> {
    let link = SchedClassifierLink::attached(
        interface,
        TcAttachType::Ingress,
        prio,
        TcHandle::from(handle),
        None,
    )
    .context(|| format!("no interface {interface}"))?;
    Ok(Filter {
        link,
        interface: interface.to_owned(),
        prio,
        handle,
    })
}

/// A netlink filter found on an interface, to delete.
struct Filter {
    link: SchedClassifierLink,
    interface: String,
    prio: u16,
    handle: u32,
}

impl Filter {
    /// Deletes the filter. `ENOENT`: the filter is gone; `ENODEV`: the
    /// interface went after it was found, and its filters with it.
    fn delete(self) -> Result<(), Error> {
        let Self {
            link,
            interface,
            prio,
            handle,
        } = self;
        match link.detach() {
            Ok(()) => Ok(()),
            Err(aya::programs::ProgramError::NetlinkError(e)) => match e.raw_os_error() {
                Some(libc::ENOENT) => {
                    tracing::warn!(interface, prio, handle, "tc filter already gone");
                    Ok(())
                }
                Some(libc::ENODEV) => {
                    tracing::info!(interface, prio, handle, "interface gone while its filter was deleted, and the filter with it");
                    Ok(())
                }
                // aya's message names only the kernel's extended ack: say the errno too.
                errno => Err(e).context(|| {
                    format!(
                        "deleting the tc filter {prio}:{handle:#x} from the ingress of {interface} ({})",
                        errno.map_or("no errno".into(), |n| std::io::Error::from_raw_os_error(n).to_string())
                    )
                }),
            },
            Err(e) => Err(e).context(|| {
                format!("deleting the tc filter {prio}:{handle:#x} from the ingress of {interface}")
            }),
        }
    }
}

/// Netlink filters attached during a failed set-up, deleted when it unwinds.
pub(crate) struct FilterGuard {
    filters: Vec<(String, u16, u32)>,
}

impl FilterGuard {
    /// An empty guard.
    pub fn new() -> Self {
        Self {
            filters: Vec::new(),
        }
    }

    /// Remembers a filter to delete if the set-up fails.
    pub fn push(&mut self, interface: &str, attached: Attached) {
        if let Attached::Filter { prio, handle } = attached {
            self.filters.push((interface.to_owned(), prio, handle));
        }
    }

    /// The set-up succeeded: the filters stay.
    pub fn disarm(mut self) {
        self.filters.clear();
    }
}

impl Drop for FilterGuard {
    fn drop(&mut self) {
        for (interface, prio, handle) in self.filters.drain(..) {
            if let Err(e) = detach_filter(&interface, prio, handle) {
                tracing::warn!(error = %e, "cannot delete a tc filter of a failed attach");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::*;

    /// Runs `program args` (in the calling thread's network namespace).
    fn run(program: &str, args: &[&str]) -> String {
        let out = Command::new(program)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("run {program} (iproute2): {e}"));
        assert!(
            out.status.success(),
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// In a namespace of its own (this thread's), a veth interface with a
    /// clsact qdisc and a classic BPF filter at priority 7, handle 1.
    fn filtered_interface() {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
            .expect("a network namespace of the test's own (needs root)");
        run(
            "ip",
            &["link", "add", "d0", "type", "veth", "peer", "name", "d1"],
        );
        run("tc", &["qdisc", "add", "dev", "d0", "clsact"]);
        run(
            "tc",
            &[
                "filter",
                "add",
                "dev",
                "d0",
                "ingress",
                "prio",
                "7",
                "handle",
                "1",
                "bpf",
                "bytecode",
                "1,6 0 0 0",
            ],
        );
    }

    #[test]
    fn a_filter_is_deleted_and_deleting_it_again_is_no_error() {
        std::thread::spawn(|| {
            filtered_interface();
            detach_filter("d0", 7, 1).expect("delete");
            let left = run("tc", &["filter", "show", "dev", "d0", "ingress"]);
            assert!(left.trim().is_empty(), "filters left: {left}");
            detach_filter("d0", 7, 1).expect("a filter already gone");
            assert!(detach_filter("nope0", 7, 1).is_err(), "no such interface");
        })
        .join()
        .expect("test thread");
    }

    /// The race of a dead shim's clean-up with CNI's: the interface is found,
    /// then deleted before its filter is.
    #[test]
    fn an_interface_that_goes_after_it_was_found_took_its_filter_with_it() {
        std::thread::spawn(|| {
            filtered_interface();
            let filter = find_filter("d0", 7, 1).expect("find");
            run("ip", &["link", "del", "d0"]);
            filter
                .delete()
                .expect("the interface went, and its filter with it");
        })
        .join()
        .expect("test thread");
    }
}
