"""Quickstart: Yao's millionaires' problem, solved securely by three simulated parties.

The program lives in `mpplug/demo.py` so that `mpplug demo` runs the same code on any install;
read it there. Alice and Bob each put their wealth; it is secret-shared among Alice, Bob and
a helper, Carol, the comparison runs on the shares (`mp.mpc`), and only the answer is opened,
to Alice and Bob.
"""

from mpplug.demo import main

if __name__ == "__main__":
    main()
