#!/usr/bin/env python3
"""Splits a perf profile of a bench run into where the CPU went.

Usage:
    perf record -F 1000 --call-graph dwarf,16384 -o run.data -- \
        target/release/nexar local --world 2 bench --ops all_gather \
        --min-bytes 4M --max-bytes 4M --iters 150 --warmup 5 --zero-copy
    perf script -i run.data > run.script
    python3 bench/cpu-split.py run.script

Each sample is put in one category by its leaf function and, for copies, by who called
it: the kernel's copies between sockets and user memory, encryption and decryption,
quinn's two copies (stream data into packets on send; each datagram out of the socket
buffer on receive), nexar's copies (received bytes into the destination; an all-gather's
own block from input to output), reductions, page faults, the bench's own work outside
the timed window (setup, checks), and the rest. Prints the share of samples per category.
"""
import collections
import re
import sys


def symbol(line):
    parts = line.strip().split(' ', 1)
    name = parts[1] if len(parts) > 1 else parts[0]
    return re.sub(r'\+0x[0-9a-f]+$', '', name.rsplit(' (', 1)[0])


COPY_LEAVES = ('memcpy', 'memmove', 'copy_nonoverlapping', 'copy_avx')
COPY_CALLERS = (
    ('write_stream_frames', 'quinn: stream data into packets'),
    ('poll_socket', 'quinn: datagram out of the socket buffer'),
    ('Buffers::put', 'nexar: received bytes into the destination'),
    ('copy_into', 'nexar: received bytes into the destination'),
    ('run_local', 'nexar: own block, input to output'),
    ('reduce', 'nexar: reduction'),
)


def category(frames, text):
    leaf = frames[0]
    stack = ' '.join(frames)
    if any(k in stack for k in ('verify', 'Case<T>::new', 'restore')):
        return 'bench (outside the timed window)'
    if 'aes_gcm_enc' in leaf:
        return 'encrypt'
    if 'aes_gcm_dec' in leaf:
        return 'decrypt'
    if leaf.startswith('_copy_to_iter'):
        return 'kernel: copy to user (receive)'
    if leaf.startswith('_copy_from_iter'):
        return 'kernel: copy from user (send)'
    if any(k in leaf for k in COPY_LEAVES):
        for key, name in COPY_CALLERS:
            if key in stack:
                return name
        return 'other copies'
    if 'reduce' in leaf.lower():
        return 'nexar: reduction'
    if 'page_fault' in stack or 'clear_page' in stack:
        return 'page faults'
    if leaf.startswith(('_raw_spin', 'finish_task_switch', '__schedule', 'schedule')):
        return 'kernel: scheduling and locks'
    if '[kernel' in text:
        return 'kernel: other (UDP, IP, system calls)'
    return 'user: other (quinn, tokio, nexar)'


def main(path):
    counts = collections.Counter()
    total = 0
    with open(path, encoding='utf-8', errors='replace') as f:
        blocks = f.read().split('\n\n')
    for block in blocks:
        lines = [l for l in block.strip().split('\n')[1:] if l.strip()]
        if not lines:
            continue
        total += 1
        counts[category([symbol(l) for l in lines], block)] += 1
    print(f'samples: {total}')
    for name, n in counts.most_common():
        print(f'{100 * n / max(total, 1):5.1f}%  {n:6d}  {name}')


if __name__ == '__main__':
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
