"""Installs the host-pickup ``.pth`` line next to the package (see hosts/pickup.py)."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "mlx_voicechat_plugin-hosts.pth"


class BuildWithPth(build_py):
    def run(self) -> None:
        super().run()
        source = Path(__file__).parent / PTH
        target = Path(self.build_lib) / PTH
        self.copy_file(str(source), str(target))

    def get_outputs(self, include_bytecode: bool = True):
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


setup(cmdclass={"build_py": BuildWithPth})
