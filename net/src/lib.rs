//! `twig-net`: a pod's network path and egress policy, in eBPF.
//!
//! Two tc programs (written in C in `bpf/pod.c`, compiled by `build.rs` with
//! clang and embedded here) join a pod's veth and its VM's tap by
//! `bpf_redirect`, with no Linux bridge. Frames from the guest are checked on
//! the way out: the source MAC and IP must be the pod's own, ARP must speak for
//! the pod's own address, IPv6, IPv4 fragments and other ethertypes are
//! dropped, and the destination is matched against the pod's [`EgressPolicy`]
//! held in an LPM trie. Flows peers start towards the pod are recorded on
//! the way in, so the guest can answer them where its policy would drop a
//! packet it started itself ([`FlowTimeouts`]; `deny` rules still drop).
//! Everything is counted per reason.
//!
//! A [`Loader`] (one per process) keeps a pool of ready instances of the
//! programs and maps; [`Loader::attach`] gives one to a pod, attaches it in
//! the pod's network namespace — as TCX links (Linux ≥ 6.6) or as
//! direct-action filters on a `clsact` qdisc ([`AttachMode`]) — and pins it
//! under a bpffs directory, so the path and its policy outlive the process
//! that set them up; [`PodNetwork::open`] finds them again.
//!
//! # Features
//!
//! - `loader` (default): everything that loads, attaches and manages the
//!   programs — aya, the embedded BPF object (and the clang compile in
//!   `build.rs`), [`Loader`], [`PodNetwork`], [`check_support`],
//!   [`ensure_bpffs`], [`Error`]. Without it the crate is only the policy
//!   types, their validation and compilation, [`effective_policy`] and the
//!   metrics renderer (what the controller needs for its CRDs), with no aya,
//!   nix or clang.
//! - `schemars`: `JsonSchema` on the policy types.

mod bound;
#[cfg(feature = "loader")]
mod bpffs;
#[cfg(feature = "loader")]
mod error;
#[cfg(feature = "loader")]
mod flows;
#[cfg(feature = "loader")]
mod forward;
#[cfg(feature = "loader")]
mod loader;
mod maps;
mod metrics;
#[cfg(feature = "loader")]
mod netns;
#[cfg(feature = "loader")]
mod pod;
mod policy;
#[cfg(feature = "loader")]
mod support;
#[cfg(feature = "loader")]
mod tc;

pub use bound::{bounded_policy, Bounded};
#[cfg(feature = "loader")]
pub use bpffs::ensure_bpffs;
#[cfg(feature = "loader")]
pub use error::Error;
#[cfg(feature = "loader")]
pub use flows::FlowTimeouts;
#[cfg(feature = "loader")]
pub use forward::{Forwarded, PortForward};
#[cfg(feature = "loader")]
pub use loader::Loader;
pub use maps::{FLOW_CAPACITY, RULE_CAPACITY};
pub use metrics::{render_openmetrics, Counter, Counters, PodCounters, Reason};
#[cfg(feature = "loader")]
pub use pod::{PodNetConfig, PodNetwork};
pub use policy::{
    effective_policy, parse_policy, Action, CompiledPolicy, EgressPolicy, EgressRule, NodeContext,
    PolicyError, PortRange, Protocol, ALWAYS_DENIED, EGRESS_POLICY_ANNOTATION, MAX_PORTS_PER_RULE,
    PRIVATE_BY_DEFAULT,
};
#[cfg(feature = "loader")]
pub use support::{check_support, check_support_with, AttachMode, ATTACH_MODE_ENV};

/// The compiled eBPF object (`bpf/pod.c`).
#[cfg(feature = "loader")]
pub(crate) static POD_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/pod.o"));

/// The compiled eBPF object of port-forward (`bpf/forward.c`).
#[cfg(feature = "loader")]
pub(crate) static FORWARD_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/forward.o"));

#[cfg(all(test, feature = "loader"))]
#[path = "../build/compile.rs"]
mod compile;

#[cfg(all(test, feature = "loader"))]
mod build_tests {
    #[test]
    fn a_missing_clang_fails_the_build_with_what_to_install() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = super::compile::compile_bpf(
            "/nonexistent/clang".as_ref(),
            "bpf/pod.c".as_ref(),
            &dir.path().join("pod.o"),
        )
        .expect_err("no clang there");
        assert!(err.contains("cannot run `/nonexistent/clang`"), "{err}");
        assert!(err.contains("install clang, llvm and libbpf-dev"), "{err}");
    }

    #[test]
    fn a_broken_program_fails_the_build_with_clangs_diagnostics() {
        let dir = tempfile::tempdir().expect("tempdir");
        let source = dir.path().join("broken.c");
        std::fs::write(&source, "int f(void) { return undeclared; }\n").expect("write");
        let err =
            super::compile::compile_bpf("clang".as_ref(), &source, &dir.path().join("broken.o"))
                .expect_err("does not compile");
        assert!(
            err.contains("failed to compile") && err.contains("undeclared"),
            "{err}"
        );
    }
}
