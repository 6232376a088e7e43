/*
 * twig-vmm test guest.
 *
 * Entered through the Linux 64-bit boot protocol (long mode, paging on,
 * interrupts off, %rsi -> boot_params). This machine's KVM emulates guest
 * ring 0 thousands of times slower than ring 3, so ring 0 does only what it
 * must: load our GDT and page tables (built at assembly time, user-accessible)
 * and iretq into ring 3 with IOPL=3. Everything else runs in ring 3 at native
 * speed and talks to the host through a mailbox in guest memory:
 *
 *   MAILBOX+0x00 cmd      host writes a command, guest clears it when done
 *                         (after counting it in done)
 *   MAILBOX+0x08 arg0
 *   MAILBOX+0x10 arg1
 *   MAILBOX+0x18 arg2
 *   MAILBOX+0x20 done     incremented after every command
 *   MAILBOX+0x28 counter  incremented by the spin command
 *   MAILBOX+0x30 magic    written once at boot
 *   MAILBOX+0x38 gen      churn: generation of the pages not yet rewritten
 *                         in this pass (read at the start, then kept up)
 *   MAILBOX+0x40 cursor   churn: the page being checked (mirrors %r11)
 *   MAILBOX+0x48 verified churn: pages checked
 *   MAILBOX+0x50 bad      churn: pages that did not hold their pattern
 *   MAILBOX+0x58 bad_page churn: the first such page (index in the range)
 *   MAILBOX+0x60 bad_word churn: its first wrong word (index in the page)
 *   MAILBOX+0x68 bad_seen churn: the value found there
 *   MAILBOX+0x70 rx       churn: network frames received (used ring)
 *   MAILBOX+0x78 tag      never touched by the guest: free for the host
 *
 * Commands: 1 print arg0 (a byte) to COM1 arg1 times (0: once, %rcx
 * counting down); 2 dirty arg1 pages from GPA arg0, writing arg2+i into
 * page i; 3 spin (counter++) until cmd changes;
 * 4 stop (i8042 reset); 5 crash (ud2 with no IDT: triple fault);
 * 6 churn over arg1 pages from GPA arg0 until cmd changes.
 *
 * Churn: page p of generation g holds g in word 0 and (g*K ^ p<<9 ^ i) in
 * word i (K a 64-bit odd constant). The guest writes generation gen into
 * every page, counts the command in done, then loops: check page
 * %r11 (cursor) against generation %r10, rewrite it for %r10+1, count it;
 * after the last page, %r10++ and start over. So pages below the cursor
 * hold %r10+1 and the others %r10. A page that does not hold its pattern
 * is counted in bad (the first one's page, word and value recorded) and
 * rewritten; the guest never stops on its own. With arg2 != 0 it also
 * drives the receive queue of a virtio-net device as a driver would: arg2
 * is a queue area prepared by the host (+0 the device's MMIO base, +8 the
 * queue size Q, +0x1000 descriptors, +0x2000 available ring, +0x3000 used
 * ring, buffers after); the guest brings the device up, posts all Q
 * buffers, and after every page, once the device has used Q/2 or more,
 * gives them back (available idx = used idx + Q) with a queue notify,
 * counting frames in rx.
 * With no command the guest writes the idle port, where the VMM parks the
 * vCPU until the host kicks it.
 */
        .set COM1,       0x3f8
        .set IDLE_PORT,  0x510
        .set I8042_CMD,  0x64
        .set MAILBOX,    0x180000
        .set USER_STACK, 0x1f0000
        .set MAGIC_LO,   0x67697774   /* "twig" */
        .set CHURN,      6
        .set CHURN_K,    0x9e3779b97f4a7c15
        .set GEN,        MAILBOX+0x38
        .set CURSOR,     MAILBOX+0x40
        .set VERIFIED,   MAILBOX+0x48
        .set BAD,        MAILBOX+0x50
        .set BAD_PAGE,   MAILBOX+0x58
        .set BAD_WORD,   MAILBOX+0x60
        .set BAD_SEEN,   MAILBOX+0x68
        .set RX,         MAILBOX+0x70
        /* virtio-mmio registers */
        .set VIRTIO_DRIVER_FEATURES,     0x20
        .set VIRTIO_DRIVER_FEATURES_SEL, 0x24
        .set VIRTIO_QUEUE_SEL,   0x30
        .set VIRTIO_QUEUE_NUM,   0x38
        .set VIRTIO_QUEUE_READY, 0x44
        .set VIRTIO_QUEUE_NOTIFY, 0x50
        .set VIRTIO_STATUS,      0x70
        .set VIRTIO_QUEUE_DESC,  0x80
        .set VIRTIO_QUEUE_AVAIL, 0x90
        .set VIRTIO_QUEUE_USED,  0xa0

        .text
        .code64
        .globl _start
_start:
        lgdt    gdt_desc
        mov     $pml4, %eax
        mov     %rax, %cr3
        pushq   $0x23                 /* SS: user data, RPL 3 */
        pushq   $USER_STACK
        pushq   $0x3002               /* RFLAGS: IOPL=3, IF=0 */
        pushq   $0x1b                 /* CS: user code, RPL 3 */
        pushq   $user_main
        iretq

user_main:
        movl    $MAGIC_LO, MAILBOX+0x30
        movl    $1, MAILBOX+0x34
        mov     $COM1, %dx
        mov     $'B', %al
        out     %al, %dx
idle:
        mov     MAILBOX, %rax
        test    %rax, %rax
        jnz     dispatch
        mov     $IDLE_PORT, %dx
        out     %al, %dx
        /* Where a vCPU parked at the idle port stands (its RIP). */
        .globl  parked
parked:
        jmp     idle

dispatch:
        cmp     $1, %rax
        je      cmd_print
        cmp     $2, %rax
        je      cmd_dirty
        cmp     $3, %rax
        je      cmd_spin
        cmp     $4, %rax
        je      cmd_stop
        cmp     $5, %rax
        je      cmd_crash
        cmp     $CHURN, %rax
        je      cmd_churn
        jmp     done                  /* unknown: acknowledge and ignore */

cmd_print:
        mov     MAILBOX+0x08, %rax
        mov     MAILBOX+0x10, %rcx    /* times (0: once) */
        mov     $COM1, %dx
1:      out     %al, %dx
        dec     %rcx
        jg      1b
        jmp     done

cmd_dirty:
        mov     MAILBOX+0x08, %rdi    /* GPA */
        mov     MAILBOX+0x10, %rcx    /* pages */
        mov     MAILBOX+0x18, %rax    /* value */
1:      test    %rcx, %rcx
        jz      done
        mov     %rax, (%rdi)
        add     $4096, %rdi
        inc     %rax
        dec     %rcx
        jmp     1b

cmd_spin:
        incq    MAILBOX+0x20
2:      incq    MAILBOX+0x28
        cmpq    $3, MAILBOX
        je      2b
        jmp     idle

cmd_stop:
        mov     $I8042_CMD, %dx
        mov     $0xfe, %al
        out     %al, %dx
        jmp     cmd_stop

cmd_crash:
        ud2

/* Writes the pattern of page %r11, generation %rax, at %rdi. Clobbers rbx, rcx, rdx. */
churn_write:
        mov     %rax, (%rdi)
        movabs  $CHURN_K, %rdx
        imul    %rax, %rdx
        mov     %r11, %rbx
        shl     $9, %rbx
        xor     %rbx, %rdx
        mov     $1, %rcx
1:      mov     %rdx, %rbx
        xor     %rcx, %rbx
        mov     %rbx, (%rdi,%rcx,8)
        inc     %rcx
        cmp     $512, %rcx
        jne     1b
        ret

cmd_churn:
        mov     MAILBOX+0x08, %r8     /* first GPA */
        mov     MAILBOX+0x10, %r9     /* pages */
        mov     MAILBOX+0x18, %r12    /* net queue area, or 0 */
        mov     GEN, %r10
        xor     %r11, %r11
3:      cmp     %r9, %r11             /* every page holds generation gen */
        je      4f
        mov     %r11, %rdi
        shl     $12, %rdi
        add     %r8, %rdi
        mov     %r10, %rax
        call    churn_write
        inc     %r11
        jmp     3b
4:      xor     %r11, %r11
        movq    $0, CURSOR
        test    %r12, %r12
        jz      5f
        call    net_up
5:      incq    MAILBOX+0x20          /* started */

churn_page:
        cmpq    $CHURN, MAILBOX
        jne     idle
        mov     %r11, %rdi
        shl     $12, %rdi
        add     %r8, %rdi
        xor     %rcx, %rcx            /* word 0: the generation */
        mov     (%rdi), %rbx
        cmp     %r10, %rbx
        jne     churn_bad
        movabs  $CHURN_K, %rdx
        imul    %r10, %rdx
        mov     %r11, %rax
        shl     $9, %rax
        xor     %rax, %rdx
        mov     $1, %rcx
6:      mov     %rdx, %rax
        xor     %rcx, %rax
        mov     (%rdi,%rcx,8), %rbx
        cmp     %rax, %rbx
        jne     churn_bad
        inc     %rcx
        cmp     $512, %rcx
        jne     6b
churn_rewrite:
        mov     %r10, %rax
        inc     %rax
        call    churn_write
        incq    VERIFIED
        inc     %r11
        cmp     %r9, %r11
        jne     7f
        xor     %r11, %r11            /* a pass is over: next generation */
        inc     %r10
        mov     %r10, GEN
7:      mov     %r11, CURSOR
        test    %r12, %r12
        jz      churn_page
        call    net_recycle
        jmp     churn_page

/* Page %r11 differs at word %rcx (value %rbx): count it, rewrite it. */
churn_bad:
        cmpq    $0, BAD
        jne     8f
        mov     %r11, BAD_PAGE
        mov     %rcx, BAD_WORD
        mov     %rbx, BAD_SEEN
8:      incq    BAD
        jmp     churn_rewrite

/* Brings up the net device's receive queue (queue 0) from the area at %r12. */
net_up:
        mov     (%r12), %r14          /* MMIO base */
        mov     8(%r12), %r13         /* queue size */
        movl    $0, VIRTIO_STATUS(%r14)           /* reset */
        movl    $1, VIRTIO_STATUS(%r14)           /* ACKNOWLEDGE */
        movl    $3, VIRTIO_STATUS(%r14)           /* DRIVER */
        movl    $1, VIRTIO_DRIVER_FEATURES_SEL(%r14)
        movl    $1, VIRTIO_DRIVER_FEATURES(%r14)  /* VIRTIO_F_VERSION_1 */
        movl    $0, VIRTIO_DRIVER_FEATURES_SEL(%r14)
        movl    $0, VIRTIO_DRIVER_FEATURES(%r14)
        movl    $0xb, VIRTIO_STATUS(%r14)         /* FEATURES_OK */
        movl    $0, VIRTIO_QUEUE_SEL(%r14)
        movl    %r13d, VIRTIO_QUEUE_NUM(%r14)
        lea     0x1000(%r12), %rax
        movl    %eax, VIRTIO_QUEUE_DESC(%r14)
        movl    $0, VIRTIO_QUEUE_DESC+4(%r14)
        lea     0x2000(%r12), %rax
        movl    %eax, VIRTIO_QUEUE_AVAIL(%r14)
        movl    $0, VIRTIO_QUEUE_AVAIL+4(%r14)
        lea     0x3000(%r12), %rax
        movl    %eax, VIRTIO_QUEUE_USED(%r14)
        movl    $0, VIRTIO_QUEUE_USED+4(%r14)
        movl    $1, VIRTIO_QUEUE_READY(%r14)
        movl    $0xf, VIRTIO_STATUS(%r14)         /* DRIVER_OK */
        movzwl  0x3002(%r12), %r15d   /* used idx seen */
        jmp     9f

/* Counts frames the device used and posts their buffers again. */
net_recycle:
        movzwl  0x3002(%r12), %edx    /* used idx */
        mov     %edx, %ecx
        sub     %r15d, %ecx
        and     $0xffff, %ecx
        mov     %r13d, %eax           /* wait for half the queue: one */
        shr     $1, %eax              /* exit per Q/2 frames */
        cmp     %eax, %ecx
        jb      10f
        add     %rcx, RX
        mov     %edx, %r15d
9:      mov     %r15d, %eax           /* available idx = used idx + Q */
        add     %r13d, %eax
        mov     %ax, 0x2002(%r12)
        movl    $0, VIRTIO_QUEUE_NOTIFY(%r14)
10:     ret

done:
        incq    MAILBOX+0x20          /* count first: cmd == 0 means done */
        movq    $0, MAILBOX
        jmp     idle

        .data
        .balign 16
gdt:
        .quad   0
        .quad   0x00af9b000000ffff    /* 0x08 kernel code */
        .quad   0x00cf93000000ffff    /* 0x10 kernel data */
        .quad   0x00affb000000ffff    /* 0x18 user code, DPL 3, long mode */
        .quad   0x00cff3000000ffff    /* 0x20 user data, DPL 3 */
gdt_end:
gdt_desc:
        .word   gdt_end - gdt - 1
        .quad   gdt

        /* Identity map of the first GiB and of the fourth (the virtio-mmio
         * windows) with 2 MiB user pages. */
        .balign 4096
pml4:
        .quad   pdpt + 0x7
        .fill   511, 8, 0
pdpt:
        .quad   pd + 0x7
        .quad   0, 0
        .quad   pd_mmio + 0x7
        .fill   508, 8, 0
pd:
        .set    i, 0
        .rept   512
        .quad   (i << 21) | 0x87
        .set    i, i + 1
        .endr
pd_mmio:
        .set    i, 0
        .rept   512
        .quad   (3 << 30) | (i << 21) | 0x9f  /* uncached */
        .set    i, i + 1
        .endr
