// SPDX-License-Identifier: (GPL-2.0-only OR Apache-2.0)
// twig-net: the data path and egress policy of one pod.
//
// Two tc programs (TCX links, or direct-action filters on a clsact qdisc on
// kernels before 6.6), attached in the pod's network namespace:
//   tap_ingress  - frames the guest sends (read from the VM's tap) are checked
//                  against the pod's identity and egress policy, then
//                  redirected out of the pod's veth.
//   veth_ingress - frames arriving on the pod's veth are redirected to the tap;
//                  the flows peers start are recorded in `flows` (a TCP
//                  connection by its SYN, an ICMP echo request, a UDP
//                  datagram only to a port the pod opted in to), so the
//                  guest may answer them even where its policy would drop
//                  a packet it started itself.
//
// The layout of every map key and value is mirrored in src/maps.rs.
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/in.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

char LICENSE[] SEC("license") = "Dual BSD/GPL";

// Reasons a frame is counted under; indices into `counters`.
enum reason {
	R_PASS_EGRESS = 0,
	R_PASS_INGRESS = 1,
	R_DROP_SPOOF_MAC = 2,
	R_DROP_SPOOF_IP = 3,
	R_DROP_ARP = 4,
	R_DROP_IPV6 = 5,
	R_DROP_FRAGMENT = 6,
	R_DROP_DENY_RULE = 7,
	R_DROP_PRIVATE = 8,
	R_DROP_DEFAULT = 9,
	R_DROP_MALFORMED = 10,
	R_DROP_ETHERTYPE = 11,
	R_DROP_NO_CONFIG = 12,
	R_PASS_REPLY = 13,
	R_MAX = 14,
};

// Rule tiers, checked in this order: a deny match drops, an allow match
// passes, a private (baseline) match drops, otherwise the default action.
enum tier {
	T_DENY = 0,
	T_ALLOW = 1,
	T_PRIVATE = 2,
};

enum state_index {
	S_ACTIVE_GEN = 0,
	S_DEFAULT_GEN0 = 1, // default action of generation 0: 0 allow, 1 deny
	S_DEFAULT_GEN1 = 2,
	S_MAX = 3,
};

#define UDP_REPLY_RANGES 8

struct pod_config {
	__u32 pod_ip;       // network byte order
	__u32 veth_ifindex;
	__u32 tap_ifindex;
	__u8 mac[6];
	__u16 pad;
	// Idle timeouts of recorded flows, in milliseconds (0: no replies).
	__u32 tcp_idle_ms;
	__u32 udp_idle_ms;
	__u32 icmp_idle_ms;
	// The pod's UDP ports (inclusive ranges, host byte order) whose
	// datagrams from a peer open a reply path; a range starting at 0 ends
	// the list, so all zeros (the default) means no UDP replies at all.
	__u16 udp_reply_ports[UDP_REPLY_RANGES][2];
};

// A flow a peer started towards the pod, as seen on the veth. For ICMP echo,
// `peer_port` is the echo identifier and `pod_port` is 0.
struct flow_key {
	__u32 peer_ip;      // network byte order
	__u16 peer_port;    // network byte order
	__u16 pod_port;     // network byte order
	__u8 proto;
	__u8 pad[3];
};

// LPM key: 64 fixed bits (gen, tier, proto, zero, port, zero) then the
// destination address; a rule for "any port" has port 0 and a rule for "any
// protocol" has proto 0.
struct rule_key {
	__u32 prefixlen;
	__u8 gen;
	__u8 tier;
	__u8 proto;
	__u8 zero;
	__u16 port;         // network byte order
	__u16 zero2;
	__u32 addr;         // network byte order
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 8192);
	__type(key, struct flow_key);
	__type(value, __u64); // last packet from the peer, bpf_ktime_get_ns()
} flows SEC(".maps");

struct counter {
	__u64 packets;
	__u64 bytes;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct pod_config);
} config SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, S_MAX);
	__type(key, __u32);
	__type(value, __u32);
} state SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct rule_key);
	__type(value, __u32);
} rules SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, R_MAX);
	__type(key, __u32);
	__type(value, struct counter);
} counters SEC(".maps");

// Where the two programs are attached: read by user space only, so that a
// restarted process detaches exactly what was attached (a netlink tc filter
// is not a BPF link and has no pin of its own).
struct attachment {
	__u32 mode;         // 1: TCX links, 2: netlink tc filters (clsact)
	__u32 tap_ifindex;
	__u32 veth_ifindex;
	__u16 tap_prio;     // netlink mode: the filters' priority and handle
	__u16 veth_prio;
	__u32 tap_handle;
	__u32 veth_handle;
	__u64 netns_dev;    // the namespace attached in (st_dev, st_ino of its file)
	__u64 netns_ino;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct attachment);
} attachment SEC(".maps");

#define IP_MF 0x2000
#define IP_OFFSET 0x1fff
// Ethernet + the longest IPv4 header + the first 14 bytes of TCP (through
// its flags; 8 bytes of UDP or ICMP echo fit in them).
#define HEADERS_MAX (ETH_HLEN + 60 + 14)
#define TCP_FLAGS_OFFSET 13
#define TCP_FLAG_SYN 0x02
#define TCP_FLAG_ACK 0x10
#define ICMP_ECHO_REPLY 0
#define ICMP_ECHO_REQUEST 8

// The first bytes of an ICMP echo request or reply.
struct icmp_echo {
	__u8 type;
	__u8 code;
	__u16 checksum;
	__u16 id;
	__u16 sequence;
};

static __always_inline int count(struct __sk_buff *skb, __u32 reason)
{
	struct counter *c = bpf_map_lookup_elem(&counters, &reason);
	if (c) {
		c->packets += 1;
		c->bytes += skb->len;
	}
	return reason;
}

static __always_inline int drop(struct __sk_buff *skb, __u32 reason)
{
	count(skb, reason);
	return TC_ACT_SHOT;
}

static __always_inline int match(__u8 gen, __u8 tier, __u8 proto, __u16 port, __u32 addr)
{
	struct rule_key key = {
		.prefixlen = 96,
		.gen = gen,
		.tier = tier,
		.proto = proto,
		.port = port,
		.addr = addr,
	};
	if (bpf_map_lookup_elem(&rules, &key))
		return 1;
	key.port = 0;
	if (bpf_map_lookup_elem(&rules, &key))
		return 1;
	key.proto = 0;
	return bpf_map_lookup_elem(&rules, &key) != NULL;
}

// Makes the first HEADERS_MAX bytes (or the whole frame) readable directly.
static __always_inline void pull_headers(struct __sk_buff *skb)
{
	if ((void *)(long)skb->data + HEADERS_MAX > (void *)(long)skb->data_end)
		bpf_skb_pull_data(skb, skb->len < HEADERS_MAX ? skb->len : HEADERS_MAX);
}

static __always_inline __u64 idle_ns(const struct pod_config *cfg, __u8 proto)
{
	__u32 ms = 0;
	if (proto == IPPROTO_TCP)
		ms = cfg->tcp_idle_ms;
	else if (proto == IPPROTO_UDP)
		ms = cfg->udp_idle_ms;
	else if (proto == IPPROTO_ICMP)
		ms = cfg->icmp_idle_ms;
	return (__u64)ms * 1000000;
}

// Whether the pod opted in to UDP replies on `port` (network byte order).
static __always_inline int udp_reply_port(const struct pod_config *cfg, __u16 port)
{
	__u16 p = bpf_ntohs(port);
#pragma unroll
	for (int i = 0; i < UDP_REPLY_RANGES; i++) {
		__u16 first = cfg->udp_reply_ports[i][0];
		if (!first)
			return 0;
		if (p >= first && p <= cfg->udp_reply_ports[i][1])
			return 1;
	}
	return 0;
}

// Whether the guest's packet answers a flow its peer started within the
// idle timeout: the peer is the destination, the ports are swapped (an echo
// reply carries the request's identifier), and for UDP the pod's port is
// still opted in. A TCP SYN without ACK opens a connection and never
// answers one.
static __always_inline int is_reply(const struct pod_config *cfg, struct iphdr *ip, void *end)
{
	struct flow_key key = {
		.peer_ip = ip->daddr,
		.proto = ip->protocol,
	};
	void *l4 = (void *)ip + ip->ihl * 4;
	if (key.proto == IPPROTO_TCP) {
		__u8 *flags = l4 + TCP_FLAGS_OFFSET;
		if ((void *)(flags + 1) > end)
			return 0;
		if ((*flags & (TCP_FLAG_SYN | TCP_FLAG_ACK)) == TCP_FLAG_SYN)
			return 0;
	}
	if (key.proto == IPPROTO_TCP || key.proto == IPPROTO_UDP) {
		__u16 *ports = l4;
		if ((void *)(ports + 2) > end)
			return 0;
		key.pod_port = ports[0];
		key.peer_port = ports[1];
		if (key.proto == IPPROTO_UDP && !udp_reply_port(cfg, key.pod_port))
			return 0;
	} else if (key.proto == IPPROTO_ICMP) {
		struct icmp_echo *echo = l4;
		if ((void *)(echo + 1) > end)
			return 0;
		if (echo->type != ICMP_ECHO_REPLY || echo->code != 0)
			return 0;
		key.peer_port = echo->id;
	} else {
		return 0;
	}
	__u64 idle = idle_ns(cfg, key.proto);
	__u64 *seen = bpf_map_lookup_elem(&flows, &key);
	if (!seen || !idle)
		return 0;
	return bpf_ktime_get_ns() - *seen < idle;
}

// Records the flow a peer starts towards the guest, or refreshes one
// already recorded, from a frame addressed to the pod (not a later
// fragment). Only three things start a flow: a TCP SYN without ACK (a
// connection the peer opens), a UDP datagram to a port the pod opted in to
// (`udp_reply_ports`), and an ICMP echo request. Any other TCP segment
// only refreshes its connection's flow if the SYN was recorded; other UDP
// and ICMP are only passed on. So a peer the policy keeps the guest from
// reaching cannot open a way out by sending a stray datagram or segment.
static __always_inline void record_flow(struct __sk_buff *skb, const struct pod_config *cfg)
{
	if (skb->vlan_present)
		return;
	pull_headers(skb);
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end || eth->h_proto != bpf_htons(ETH_P_IP))
		return;
	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > end || ip->version != 4 || ip->ihl < 5)
		return;
	if (ip->daddr != cfg->pod_ip || (ip->frag_off & bpf_htons(IP_OFFSET)))
		return;
	struct flow_key key = {
		.peer_ip = ip->saddr,
		.proto = ip->protocol,
	};
	void *l4 = (void *)ip + ip->ihl * 4;
	int opens = 1;
	if (key.proto == IPPROTO_TCP || key.proto == IPPROTO_UDP) {
		__u16 *ports = l4;
		if ((void *)(ports + 2) > end)
			return;
		key.peer_port = ports[0];
		key.pod_port = ports[1];
		if (key.proto == IPPROTO_TCP) {
			__u8 *flags = l4 + TCP_FLAGS_OFFSET;
			if ((void *)(flags + 1) > end)
				return;
			opens = (*flags & (TCP_FLAG_SYN | TCP_FLAG_ACK)) == TCP_FLAG_SYN;
		} else if (!udp_reply_port(cfg, key.pod_port)) {
			return;
		}
	} else if (key.proto == IPPROTO_ICMP) {
		struct icmp_echo *echo = l4;
		if ((void *)(echo + 1) > end)
			return;
		if (echo->type != ICMP_ECHO_REQUEST || echo->code != 0)
			return;
		key.peer_port = echo->id;
	} else {
		return;
	}
	__u64 idle = idle_ns(cfg, key.proto);
	if (!idle)
		return;
	__u64 now = bpf_ktime_get_ns();
	__u64 *seen = bpf_map_lookup_elem(&flows, &key);
	if (seen) {
		// A segment of an idle-expired connection revives nothing.
		if (opens || now - *seen < idle)
			*seen = now;
	} else if (opens) {
		bpf_map_update_elem(&flows, &key, &now, BPF_ANY);
	}
}

static __always_inline int same_mac(const __u8 *a, const __u8 *b)
{
	return a[0] == b[0] && a[1] == b[1] && a[2] == b[2] &&
	       a[3] == b[3] && a[4] == b[4] && a[5] == b[5];
}

#define ARPHRD_ETHER 1

// An Ethernet/IPv4 ARP packet (linux/if_arp.h pulls in libc headers).
struct arp_ipv4 {
	__be16 ar_hrd;
	__be16 ar_pro;
	__u8 ar_hln;
	__u8 ar_pln;
	__be16 ar_op;
	__u8 sha[ETH_ALEN];
	__u8 spa[4];
	__u8 tha[ETH_ALEN];
	__u8 tpa[4];
} __attribute__((packed));

SEC("classifier")
int tap_ingress(struct __sk_buff *skb)
{
	__u32 zero = 0;
	struct pod_config *cfg = bpf_map_lookup_elem(&config, &zero);
	if (!cfg)
		return drop(skb, R_DROP_NO_CONFIG);

	// The stack moves an 802.1Q tag out of the frame before tc sees it.
	if (skb->vlan_present)
		return drop(skb, R_DROP_ETHERTYPE);
	pull_headers(skb);
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;

	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return drop(skb, R_DROP_MALFORMED);
	if (!same_mac(eth->h_source, cfg->mac))
		return drop(skb, R_DROP_SPOOF_MAC);

	if (eth->h_proto == bpf_htons(ETH_P_ARP)) {
		struct arp_ipv4 *arp = (void *)(eth + 1);
		if ((void *)(arp + 1) > end)
			return drop(skb, R_DROP_MALFORMED);
		if (arp->ar_hrd != bpf_htons(ARPHRD_ETHER) ||
		    arp->ar_pro != bpf_htons(ETH_P_IP) ||
		    arp->ar_hln != ETH_ALEN || arp->ar_pln != 4)
			return drop(skb, R_DROP_ARP);
		__u32 spa;
		__builtin_memcpy(&spa, arp->spa, 4);
		if (spa != cfg->pod_ip || !same_mac(arp->sha, cfg->mac))
			return drop(skb, R_DROP_ARP);
		count(skb, R_PASS_EGRESS);
		return bpf_redirect(cfg->veth_ifindex, 0);
	}
	if (eth->h_proto == bpf_htons(ETH_P_IPV6))
		return drop(skb, R_DROP_IPV6);
	if (eth->h_proto != bpf_htons(ETH_P_IP))
		return drop(skb, R_DROP_ETHERTYPE);

	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > end)
		return drop(skb, R_DROP_MALFORMED);
	if (ip->version != 4 || ip->ihl < 5)
		return drop(skb, R_DROP_MALFORMED);
	if (ip->saddr != cfg->pod_ip)
		return drop(skb, R_DROP_SPOOF_IP);
	if (ip->frag_off & bpf_htons(IP_MF | IP_OFFSET))
		return drop(skb, R_DROP_FRAGMENT);

	__u8 proto = ip->protocol;
	__u16 port = 0;
	if (proto == IPPROTO_TCP || proto == IPPROTO_UDP) {
		__u16 *l4 = (void *)ip + ip->ihl * 4;
		if ((void *)(l4 + 2) > end)
			return drop(skb, R_DROP_MALFORMED);
		port = l4[1];
	}

	__u32 gen_index = S_ACTIVE_GEN;
	__u32 *gen_p = bpf_map_lookup_elem(&state, &gen_index);
	if (!gen_p)
		return drop(skb, R_DROP_NO_CONFIG);
	__u8 gen = *gen_p & 1;
	__u32 daddr = ip->daddr;

	// A deny rule drops even replies; a packet the rest of the policy
	// would drop passes if it answers a flow the peer started.
	if (match(gen, T_DENY, proto, port, daddr))
		return drop(skb, R_DROP_DENY_RULE);
	if (!match(gen, T_ALLOW, proto, port, daddr)) {
		__u32 reason = 0;
		if (match(gen, T_PRIVATE, proto, port, daddr)) {
			reason = R_DROP_PRIVATE;
		} else {
			__u32 default_index = gen ? S_DEFAULT_GEN1 : S_DEFAULT_GEN0;
			__u32 *deny_by_default = bpf_map_lookup_elem(&state, &default_index);
			if (!deny_by_default || *deny_by_default)
				reason = R_DROP_DEFAULT;
		}
		if (reason) {
			if (!is_reply(cfg, ip, end))
				return drop(skb, reason);
			count(skb, R_PASS_REPLY);
			return bpf_redirect(cfg->veth_ifindex, 0);
		}
	}
	count(skb, R_PASS_EGRESS);
	return bpf_redirect(cfg->veth_ifindex, 0);
}

SEC("classifier")
int veth_ingress(struct __sk_buff *skb)
{
	__u32 zero = 0;
	struct pod_config *cfg = bpf_map_lookup_elem(&config, &zero);
	if (!cfg)
		return drop(skb, R_DROP_NO_CONFIG);
	record_flow(skb, cfg);
	count(skb, R_PASS_INGRESS);
	return bpf_redirect(cfg->tap_ifindex, 0);
}
