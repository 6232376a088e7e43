// SPDX-License-Identifier: (GPL-2.0-only OR Apache-2.0)
// twig-net: port-forward into a pod's VM.
//
// One sk_lookup program, attached to a pod's network namespace (a BPF link
// on the namespace). containerd's CRI PortForward dials localhost:<port>
// inside that namespace, where on Twig nothing of the pod listens (the
// pod's processes run in its VM). Every TCP connection to 127.0.0.1 or ::1,
// on any port, is handed to the one listening socket in `forward_listener`
// (a dual-stack IPv6 socket held by the shim); the accepted socket's local
// address is the address and port that was dialled, and the shim forwards
// the connection to that port inside the guest.
//
// sk_lookup runs before the kernel's own listener lookup, and a program has
// no helper to ask whether a real socket listens on the port: the steering
// covers every loopback port (the pod's loopback is the guest's). Other
// destinations (127.0.0.2, the pod's IP) and UDP are left to the kernel.
#include <linux/bpf.h>
#include <linux/in.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

char LICENSE[] SEC("license") = "Dual BSD/GPL";

#define AF_INET 2
#define AF_INET6 10

struct {
	__uint(type, BPF_MAP_TYPE_SOCKMAP);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} forward_listener SEC(".maps");

static __always_inline int is_loopback(const struct bpf_sk_lookup *ctx)
{
	if (ctx->family == AF_INET)
		return ctx->local_ip4 == bpf_htonl(0x7f000001);
	if (ctx->family == AF_INET6)
		return ctx->local_ip6[0] == 0 && ctx->local_ip6[1] == 0 &&
		       ctx->local_ip6[2] == 0 &&
		       ctx->local_ip6[3] == bpf_htonl(1);
	return 0;
}

SEC("sk_lookup")
int loopback_to_shim(struct bpf_sk_lookup *ctx)
{
	const __u32 key = 0;
	struct bpf_sock *sk;

	if (ctx->protocol != IPPROTO_TCP || !is_loopback(ctx))
		return SK_PASS;
	sk = bpf_map_lookup_elem(&forward_listener, &key);
	if (!sk)
		// No listener (yet, or any more): the kernel's own lookup.
		return SK_PASS;
	// An error leaves the lookup to the kernel too.
	bpf_sk_assign(ctx, sk, 0);
	bpf_sk_release(sk);
	return SK_PASS;
}
