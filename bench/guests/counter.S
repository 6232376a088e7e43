/*
 * The counter guest of `twig-bench fc`: one guest image that both twig-vmm
 * and Firecracker boot (an ELF loaded at 1 MiB, entered through the Linux
 * 64-bit boot protocol: long mode, paging on, interrupts off) and that needs
 * no host commands, so each VMM is driven only through its own API.
 *
 * Like twig-vmm's test guest (vmm/guests/testguest.S) it drops to ring 3 at
 * once (this machine's nested KVM emulates guest ring 0), with IOPL=3 and
 * interrupts off. Then, for c = 0, 1, 2, ...:
 *   - it checks that its counter in memory (COUNTER) equals the one in %r12,
 *     and that scratch page c mod 1000 (from 16 MiB) holds c - 1000 (0 for
 *     c < 1000), then writes c there: memory restored from a snapshot must
 *     hold what the guest wrote before it;
 *   - it prints c in decimal and a newline on COM1;
 *   - it waits DELAY turns of a register loop (about 0.1 ms here).
 * Its serial output is therefore exactly "0\n1\n2\n..." ; on a failed check
 * it prints "E<c>\n" and resets through the i8042 (both VMMs then stop).
 */
        .set COM1,       0x3f8
        .set I8042_CMD,  0x64
        .set COUNTER,    0x180000
        .set USER_STACK, 0x1f0000
        .set SCRATCH,    0x1000000
        .set PAGES,      1000
        .set DELAY,      300000

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
        xor     %r12, %r12            /* c */
        movq    $0, COUNTER
line:
        /* COUNTER must equal c */
        cmp     COUNTER, %r12
        jne     bad
        /* page c mod PAGES must hold c - PAGES (0 while c < PAGES) */
        mov     %r12, %rax
        xor     %edx, %edx
        mov     $PAGES, %rcx
        div     %rcx                  /* rdx = c mod PAGES */
        shl     $12, %rdx
        add     $SCRATCH, %rdx
        mov     %r12, %rax
        sub     $PAGES, %rax
        jae     1f
        xor     %eax, %eax
1:      cmp     (%rdx), %rax
        jne     bad
        mov     %r12, (%rdx)
        /* print c in decimal, then '\n' */
        mov     %r12, %rax
        call    print_dec
        mov     $'\n', %al
        mov     $COM1, %dx
        out     %al, %dx
        /* next */
        inc     %r12
        incq    COUNTER
        /* wait: DELAY turns of a register loop (not the TSC, whose value
         * after a restore differs between VMMs: the wait left at a
         * snapshot must be the same for both) */
        mov     $DELAY, %rcx
2:      dec     %rcx
        jnz     2b
        jmp     line

/* Prints %rax in decimal on COM1. */
print_dec:
        mov     %rsp, %rsi
        sub     $32, %rsp
        mov     %rsi, %rdi            /* digits grow down from %rdi */
        mov     $10, %rcx
3:      xor     %edx, %edx
        div     %rcx
        add     $'0', %dl
        dec     %rdi
        mov     %dl, (%rdi)
        test    %rax, %rax
        jnz     3b
        mov     $COM1, %dx
4:      mov     (%rdi), %al
        out     %al, %dx
        inc     %rdi
        cmp     %rsi, %rdi
        jb      4b
        mov     %rsi, %rsp
        ret

bad:
        mov     $COM1, %dx
        mov     $'E', %al
        out     %al, %dx
        mov     %r12, %rax
        call    print_dec
        mov     $'\n', %al
        mov     $COM1, %dx
        out     %al, %dx
        mov     $0xfe, %al
        out     %al, $I8042_CMD
5:      pause
        jmp     5b

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

        /* Identity map of the first GiB with 2 MiB user pages. */
        .balign 4096
pml4:
        .quad   pdpt + 0x7
        .fill   511, 8, 0
pdpt:
        .quad   pd + 0x7
        .fill   511, 8, 0
pd:
        .set    i, 0
        .rept   512
        .quad   (i << 21) | 0x87
        .set    i, i + 1
        .endr
