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
 *
 * Commands: 1 print arg0 (a byte) to COM1; 2 dirty arg1 pages from GPA arg0,
 * writing arg2+i into page i; 3 spin (counter++) until cmd changes;
 * 4 stop (i8042 reset); 5 crash (ud2 with no IDT: triple fault).
 * With no command the guest writes the idle port, where the VMM parks the
 * vCPU until the host kicks it.
 */
        .set COM1,       0x3f8
        .set IDLE_PORT,  0x510
        .set I8042_CMD,  0x64
        .set MAILBOX,    0x180000
        .set USER_STACK, 0x1f0000
        .set MAGIC_LO,   0x67697774   /* "twig" */

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
        jmp     done                  /* unknown: acknowledge and ignore */

cmd_print:
        mov     MAILBOX+0x08, %rax
        mov     $COM1, %dx
        out     %al, %dx
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
